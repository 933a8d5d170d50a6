"""What the kernel says of this CPU, independently of maru: the tests' oracle for the
features maru detects itself (AVX2, AMX tiles)."""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists (none where there is no such file)."""
    if not CPUINFO.exists():
        return set()
    lines = CPUINFO.read_text().splitlines()
    return {flag for line in lines if line.startswith("flags") for flag in line.split()}
