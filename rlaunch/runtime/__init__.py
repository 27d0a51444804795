"""The worker runtime (``import rlaunch``): groups that can be swapped, a per-step vote, live moves.

Imported lazily by :func:`rlaunch.init` so that the agent and the CLI never import torch.
"""
