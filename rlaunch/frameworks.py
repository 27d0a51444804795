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
from dataclasses import dataclass

from rlaunch.errors import UsageError

#: distribution -> the versions its integration supports (pip's specifier syntax)
SUPPORTED = {
    "pytorch-lightning": ">=2.6,<2.7",
    "lightning-fabric": ">=2.6,<2.7",
    "lightning": ">=2.6,<2.7",
    "accelerate": ">=1.15,<1.16",
}
#: distribution -> the extra that installs it
EXTRAS = {
    "pytorch-lightning": "lightning",
    "lightning-fabric": "lightning",
    "lightning": "lightning",
    "accelerate": "accelerate",
}


@dataclass(frozen=True)
class LightningPackaging:
    """One of the two ways Lightning is shipped: the same classes under two sets of module names."""

    name: str  # as a sentence names it
    distributions: tuple[str, ...]
    trainer: str  # the package of the Trainer
    fabric: str  # the package of Fabric

    def imported(self) -> bool:
        return any(sys.modules.get(name) is not None for name in (self.trainer, self.fabric))


#: ``import pytorch_lightning as pl``, ``from lightning_fabric import Fabric``
PACKAGES = LightningPackaging(
    "the pytorch_lightning and lightning_fabric packages", ("pytorch-lightning", "lightning-fabric"),
    "pytorch_lightning", "lightning_fabric",
)  # fmt: skip
#: ``import lightning as L`` (``L.Trainer``, ``L.Fabric``)
UNIFIED = LightningPackaging("the unified lightning package", ("lightning",), "lightning.pytorch", "lightning.fabric")


def lightning_packaging() -> LightningPackaging:
    """The Lightning the script trains with: the one it imported (both: the unified one), else the one
    installed (both installed: the packages). A Trainer or Fabric takes only strategies of its own
    packaging, so ``rlaunch.lightning`` is built on this one's modules (see
    :mod:`rlaunch.lightning.packages`)."""
    for packaging in (UNIFIED, PACKAGES):
        if packaging.imported():
            return packaging
    if all(_installed(d) for d in PACKAGES.distributions) or not _installed("lightning"):
        return PACKAGES
    return UNIFIED


def require_lightning(what: str, packaging: LightningPackaging) -> None:
    """Check the distributions of ``packaging``, before anything imports them."""
    for distribution in packaging.distributions:
        require(distribution, what)


def other_packaging(packaging: LightningPackaging) -> LightningPackaging:
    """The packaging that ``packaging`` is not."""
    return UNIFIED if packaging is PACKAGES else PACKAGES


def other_lightning(what: str, packaging: LightningPackaging) -> str:
    """Why ``what``, built on ``packaging``, cannot serve this script: it imported the other packaging since
    ``packaging`` was chosen ("" when it did not)."""
    other = other_packaging(packaging)
    if not other.imported():
        return ""
    return (
        f"{what} was built on {packaging.name}, the Lightning found when the strategy was first used, and this "
        f"script imported {other.name} after that, whose Trainer and Fabric take only strategies of their own; "
        "import Lightning before the first use of rlaunch.lightning.Strategy or FabricStrategy."
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
