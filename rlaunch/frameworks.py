"""The framework versions rlaunch's integrations support, and the check each makes at start.

``rlaunch.lightning`` and ``rlaunch.accelerate`` hand a rank's place in a framework's own loop to
a joiner, which means reading attributes those frameworks keep private (Lightning's fit loop
progress, Accelerate's gradient state). Each integration therefore supports the minor versions
it was built and tested against, declared here and in the package's optional extras
(``pip install 'rlaunch[lightning]'``, ``'rlaunch[accelerate]'``; a unit test keeps the two
alike), and refuses any other version at start with a sentence rather than guess.
"""

from __future__ import annotations

import importlib.metadata
import sys

from rlaunch.errors import UsageError

#: distribution -> the versions its integration supports (pip's specifier syntax)
SUPPORTED = {
    "pytorch-lightning": ">=2.6,<2.7",
    "lightning-fabric": ">=2.6,<2.7",
    "accelerate": ">=1.15,<1.16",
}
#: distribution -> the extra that installs it
EXTRAS = {"pytorch-lightning": "lightning", "lightning-fabric": "lightning", "accelerate": "accelerate"}


def require_lightning(what: str) -> None:
    """Check both distributions ``rlaunch.lightning`` imports, before anything imports them.

    The unified ``lightning`` distribution (``import lightning as L``) ships the same classes under
    other names (``lightning.pytorch.Trainer``), whose Trainer and Fabric take only strategies of
    their own package: when it is what is installed, the sentence says what to install and import.
    """
    for distribution in ("pytorch-lightning", "lightning-fabric"):
        try:
            require(distribution, what)
        except UsageError:
            if _installed("lightning") and not _installed(distribution):
                raise UsageError(unified_lightning(what)) from None
            raise


def refuse_unified_lightning(what: str) -> None:
    """Refuse a script that imported the unified ``lightning`` package (see :func:`require_lightning`):
    its ``L.Trainer`` or ``L.Fabric`` would not take this strategy (Lightning refuses to mix the two)."""
    if "lightning.pytorch" in sys.modules or "lightning.fabric" in sys.modules:
        raise UsageError(unified_lightning(what))


def unified_lightning(what: str) -> str:
    return (
        f"{what} is a strategy of the pytorch-lightning and lightning-fabric packages, and this script uses the "
        "unified lightning package (import lightning as L), whose Trainer and Fabric take only strategies of their "
        "own package; pip install 'rlaunch[lightning]' and import pytorch_lightning as pl (pl.Trainer) and "
        "lightning_fabric (Fabric) instead of lightning."
    )


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def require(distribution: str, what: str) -> str:
    """Check that the installed ``distribution`` is a supported version; return that version.

    ``what`` names the integration in the sentence ("rlaunch.lightning.Strategy").
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    wanted = SUPPORTED[distribution]
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise UsageError(
            f"{what} needs {distribution} {wanted}, which is not installed: "
            f"pip install 'rlaunch[{EXTRAS[distribution]}]'."
        ) from None
    if Version(installed) not in SpecifierSet(wanted):
        raise UsageError(
            f"{what} supports {distribution} {wanted} (it reads that version's loop state to hand a rank over "
            f"live), but {installed} is installed: pip install 'rlaunch[{EXTRAS[distribution]}]' installs a "
            "supported one."
        )
    return installed
