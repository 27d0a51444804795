"""Live moves for PyTorch Lightning: ``Trainer(strategy=rlaunch.lightning.Strategy())``.

Importing this package imports ``pytorch_lightning`` (``pip install 'rlaunch[lightning]'``);
``import rlaunch`` never does. See :mod:`rlaunch.lightning.strategy`.
"""

from __future__ import annotations

from rlaunch.lightning.strategy import Strategy

__all__ = ["Strategy"]
