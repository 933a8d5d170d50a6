"""The CPU's caches, which a measurement of memory speed must outgrow."""

from __future__ import annotations

from pathlib import Path

CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
UNKNOWN_BYTES = 64 * 2**20
"""Taken for the last-level cache where Linux does not say."""
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache_bytes() -> int:
    """The size of the CPU's last-level cache, from Linux's sysfs (`os.sysconf` has no
    name for it in CPython); `UNKNOWN_BYTES` where Linux does not say."""
    sizes = [parse_cache_size(path.read_text()) for path in CACHES.glob("index*/size")]
    return max(sizes, default=UNKNOWN_BYTES)


def parse_cache_size(text: str) -> int:
    """Bytes of a sysfs cache size: `32768K`, `2M` or a plain number."""
    text = text.strip()
    return int(text.rstrip("KMG")) * UNITS.get(text[-1:], 1)
