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

from rlaunch.errors import UsageError

#: distribution -> the versions its integration supports (pip's specifier syntax)
SUPPORTED = {
    "pytorch-lightning": ">=2.6,<2.7",
    "lightning-fabric": ">=2.6,<2.7",
    "accelerate": ">=1.15,<1.16",
}
#: distribution -> the extra that installs it
EXTRAS = {"pytorch-lightning": "lightning", "lightning-fabric": "lightning", "accelerate": "accelerate"}


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
