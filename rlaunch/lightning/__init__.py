"""Live moves for PyTorch Lightning: ``Trainer(strategy=rlaunch.lightning.Strategy())``, and
``Fabric(strategy=rlaunch.lightning.FabricStrategy())``.

Importing this package imports Lightning (``pip install 'rlaunch[lightning]'``): the
``pytorch_lightning`` and ``lightning_fabric`` packages, or the unified ``lightning`` package if that
is what the script imported or what is installed (see :mod:`rlaunch.lightning.packages`); ``import
rlaunch`` never does. Its versions are checked first, so a missing or unsupported Lightning is
refused with a sentence, not an ImportError from inside Lightning. See :mod:`rlaunch.lightning.strategy`
and :mod:`rlaunch.lightning.fabric`.
"""

from __future__ import annotations

from rlaunch.runtime.runtime import report_errors_as_sentences

report_errors_as_sentences()
# the versions are checked first, before anything imports Lightning
from rlaunch.lightning import packages  # noqa: E402, F401
from rlaunch.lightning.fabric import FabricStrategy  # noqa: E402 - after the version check
from rlaunch.lightning.strategy import Strategy  # noqa: E402 - after the version check

__all__ = ["FabricStrategy", "Strategy"]
