"""A real installed distribution whose `maru` plugin fails to import, as on a node that
lacks a library the plugin needs.

`install_broken_plugin(root)` writes the package `maru_broken_plugin` (it raises
ImportError) and its `maru_broken_plugin-0.1.dist-info` (entry point `broken` in group
`maru`) under `root`: a subprocess with `root` on its PYTHONPATH, or this process with
`root` on `sys.path`, finds the entry point as if pip had installed it. Every import
attempt appends a line to the file that `BROKEN_PLUGIN_MARKER` names, so a test can tell
that a blocked plugin was never imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

ENTRY_POINT = "broken"
DISTRIBUTION = "maru-broken-plugin"
MODULE = "maru_broken_plugin"
ERROR = "ImportError: needs libfoo"
"""What the failure of its import says: the exception's type and message."""
DESCRIBED = (
    f"plugin {ENTRY_POINT!r} (entry point {ENTRY_POINT} = {MODULE}, "
    f"distribution {DISTRIBUTION!r} 0.1)"
)
"""How maru names the plugin in logs, errors and `maru info`."""
MARKER_ENV = "BROKEN_PLUGIN_MARKER"

MODULE_SOURCE = f'''"""A maru plugin that needs a library this node lacks."""

import os

if os.environ.get("{MARKER_ENV}"):
    with open(os.environ["{MARKER_ENV}"], "a") as marker:
        marker.write("imported\\n")
raise ImportError("needs libfoo")
'''


@dataclass(frozen=True)
class BrokenPlugin:
    """The broken distribution installed under `root`; `marker` counts its imports."""

    root: Path
    marker: Path

    def variables(self) -> dict[str, str]:
        """What a process needs in its environment to find the distribution."""
        path = [str(self.root), *filter(None, [os.environ.get("PYTHONPATH")])]
        return {"PYTHONPATH": os.pathsep.join(path), MARKER_ENV: str(self.marker)}

    def env(self, **variables: str) -> dict[str, str]:
        """A subprocess's environment: this one's, finding the distribution, plus `variables`."""
        return {**os.environ, **self.variables(), **variables}

    def imports(self) -> int:
        """How many times a process tried to import the plugin."""
        return len(self.marker.read_text().splitlines()) if self.marker.exists() else 0


def install_broken_plugin(root: Path) -> BrokenPlugin:
    """Install the broken distribution under `root` (a folder for sys.path/PYTHONPATH)."""
    package = root / MODULE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(MODULE_SOURCE)
    info = root / f"{MODULE}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[maru]\n{ENTRY_POINT} = {MODULE}\n")
    return BrokenPlugin(root, root.parent / f"{MODULE}-imports.txt")


def installed_here(root: Path, monkeypatch: pytest.MonkeyPatch) -> BrokenPlugin:
    """The broken distribution installed for this process until the test ends, and a
    process-wide plugin manager to be built afresh, so it finds it (the test's own
    manager is dropped at teardown)."""
    plugin = install_broken_plugin(root)
    monkeypatch.syspath_prepend(str(plugin.root))
    monkeypatch.setenv(MARKER_ENV, str(plugin.marker))
    fresh_plugin_manager(monkeypatch)
    return plugin


def fresh_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next `get_plugin_manager()` build a new process-wide manager (reading the
    environment and entry points as they are now); the old one is back after the test."""
    monkeypatch.setattr("maru.plugins._manager", None)
