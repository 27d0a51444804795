"""rlaunch: a torchrun-compatible launcher that keeps jobs running through machine faults."""

__version__ = "0.1.0"
