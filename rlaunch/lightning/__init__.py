"""Live moves for PyTorch Lightning: ``Trainer(strategy=rlaunch.lightning.Strategy())``, and
``Fabric(strategy=rlaunch.lightning.FabricStrategy())``.

Importing this package imports ``pytorch_lightning`` and ``lightning_fabric`` (``pip install
'rlaunch[lightning]'``); ``import rlaunch`` never does. See :mod:`rlaunch.lightning.strategy` and
:mod:`rlaunch.lightning.fabric`.
"""

from __future__ import annotations

from rlaunch.lightning.fabric import FabricStrategy
from rlaunch.lightning.strategy import Strategy

__all__ = ["FabricStrategy", "Strategy"]
