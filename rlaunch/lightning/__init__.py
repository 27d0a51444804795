"""Live moves for PyTorch Lightning: ``Trainer(strategy=rlaunch.lightning.Strategy())``, and
``Fabric(strategy=rlaunch.lightning.FabricStrategy())``.

Importing this package checks Lightning's versions (``pip install 'rlaunch[lightning]'``), so a
missing or unsupported Lightning is refused with a sentence, not an ImportError from inside
Lightning; ``import rlaunch`` never does. Lightning itself is imported at the first use of
``Strategy`` or ``FabricStrategy``, once the script's own imports ran: the ``pytorch_lightning`` and
``lightning_fabric`` packages, or the unified ``lightning`` package if that is what the script
imported by then (see :mod:`rlaunch.lightning.packages`): ``import rlaunch.lightning`` may come
before ``import lightning``, as long as ``rlaunch.lightning.Strategy`` is used after it. See
:mod:`rlaunch.lightning.strategy` and :mod:`rlaunch.lightning.fabric`.
"""

from __future__ import annotations

from typing import Any

from rlaunch.frameworks import lightning_packaging, require_lightning
from rlaunch.runtime.runtime import report_errors_as_sentences

report_errors_as_sentences()
require_lightning("rlaunch.lightning", lightning_packaging())  # the one chosen at first use is checked again

__all__ = ["FabricStrategy", "Strategy"]


def __getattr__(name: str) -> Any:
    """``Strategy`` and ``FabricStrategy``, built at their first use on the Lightning the script imported."""
    if name == "Strategy":
        from rlaunch.lightning.strategy import Strategy

        return Strategy
    if name == "FabricStrategy":
        from rlaunch.lightning.fabric import FabricStrategy

        return FabricStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
