"""Live moves for PyTorch Lightning: ``Trainer(strategy=rlaunch.lightning.Strategy())``, and
``Fabric(strategy=rlaunch.lightning.FabricStrategy())``.

Importing this package imports ``pytorch_lightning`` and ``lightning_fabric`` (``pip install
'rlaunch[lightning]'``); ``import rlaunch`` never does. Their versions are checked first, so a
missing or unsupported Lightning (or the unified ``lightning`` package in their place) is refused
with a sentence, not an ImportError from inside Lightning. See :mod:`rlaunch.lightning.strategy`
and :mod:`rlaunch.lightning.fabric`.
"""

from __future__ import annotations

from rlaunch.frameworks import require_lightning
from rlaunch.runtime.runtime import report_errors_as_sentences

report_errors_as_sentences()
require_lightning("rlaunch.lightning")

from rlaunch.lightning.fabric import FabricStrategy  # noqa: E402 - after the version check
from rlaunch.lightning.strategy import Strategy  # noqa: E402 - after the version check

__all__ = ["FabricStrategy", "Strategy"]
