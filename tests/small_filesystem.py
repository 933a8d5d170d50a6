"""Run a Python script with a small, empty filesystem of its own (a tmpfs), to fill it.

The tmpfs is mounted in a private mount namespace (`unshare`), so nothing outside the
script's process sees it and it vanishes with the process: as root, a mount namespace
alone; otherwise a user namespace too (unprivileged, where the kernel allows it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


def run_on_small_filesystem(script: str, size: str, mountpoint: Path) -> str:
    """Run `script` with `sys.argv[1]` a fresh tmpfs of `size` mounted at `mountpoint`;
    its stdout. Fails the test, saying what is missing, where no namespace can be made."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare is missing: install util-linux (apt-get install util-linux)")
    mountpoint.mkdir(parents=True, exist_ok=True)
    namespaces = ["--mount"] if os.geteuid() == 0 else ["--map-root-user", "--mount"]
    command = [
        unshare,
        *namespaces,
        "sh",
        "-c",
        'mount -t tmpfs -o size="$1" maru-test "$2" && exec "$3" -c "$4" "$2"',
        "sh",
        size,
        str(mountpoint),
        sys.executable,
        script,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    if done.returncode and "mount" in done.stderr and "Traceback" not in done.stderr:
        pytest.fail(
            f"cannot mount a small tmpfs for this test ({done.stderr.strip()}): run the "
            "suite as root, or where unprivileged user namespaces are allowed "
            "(sysctl kernel.unprivileged_userns_clone=1)"
        )
    assert done.returncode == 0, done.stderr
    return done.stdout
