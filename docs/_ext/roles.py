"""A griffe extension for the API reference: the docstrings' Sphinx roles read as code.

rlaunch's docstrings write ``code`` in double backticks (Markdown reads it as code too) and name
other objects with Sphinx roles (:class:`SwitchableGroup`, :mod:`rlaunch.runtime.recovery`,
:meth:`track_per_rank`), which Markdown would print as they are. This turns a role into a code
span of its target, and an RST literal-block marker (a paragraph ending in ``::``) into a colon
(the indented block after it is a code block in Markdown as well). Loaded by mkdocs.yml's
mkdocstrings options; excluded from the built site.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension

ROLE = re.compile(r":(?:class|mod|meth|func|attr|obj|exc|data):`~?([^`]+)`")
LITERAL_BLOCK = re.compile(r"::$", re.MULTILINE)


def markdown(text: str) -> str:
    """``text`` with Sphinx roles as code spans and ``::`` literal-block markers as colons."""
    return LITERAL_BLOCK.sub(":", ROLE.sub(r"`\1`", text))


class SphinxRolesToCode(Extension):
    """Rewrites every docstring griffe loads (see :func:`markdown`)."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
