"""The Lightning modules ``rlaunch.lightning`` is built on, from the packaging the script trains with.

Lightning ships the same classes twice: in the ``pytorch_lightning`` and ``lightning_fabric``
packages, and in the unified ``lightning`` package (``import lightning as L``) as
``lightning.pytorch`` and ``lightning.fabric``. A Trainer takes only a strategy of its own
packaging, so the integration's classes subclass and import the modules of the one found when this
module is first imported, at the first use of ``rlaunch.lightning.Strategy`` or ``FabricStrategy``
(see :mod:`rlaunch.lightning`): the one the script imported, else the one installed
(:func:`rlaunch.frameworks.lightning_packaging`). Its versions are checked here, before anything of
Lightning's is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlaunch.errors import UsageError
from rlaunch.frameworks import lightning_packaging, other_lightning, other_packaging, require_lightning

PACKAGING = lightning_packaging()
#: the other packaging had been imported too (the unified one was chosen then): its later import is no sign
_OTHER_BEFORE = other_packaging(PACKAGING).imported()
require_lightning("rlaunch.lightning", PACKAGING)


def trainer(module: str = "") -> Any:
    """A module of the Trainer's package (``trainer("callbacks")``: ``pytorch_lightning.callbacks``)."""
    return importlib.import_module(f"{PACKAGING.trainer}.{module}" if module else PACKAGING.trainer)


def fabric(module: str = "") -> Any:
    """A module of Fabric's package (``fabric("strategies")``: ``lightning_fabric.strategies``)."""
    return importlib.import_module(f"{PACKAGING.fabric}.{module}" if module else PACKAGING.fabric)


def check(what: str) -> None:
    """(at a strategy's construction) The versions again, and no other packaging imported since this one was
    chosen (the script trains with that one, whose Trainer would refuse this strategy with a traceback)."""
    require_lightning(what, PACKAGING)
    why = "" if _OTHER_BEFORE else other_lightning(what, PACKAGING)
    if why:
        raise UsageError(why)
