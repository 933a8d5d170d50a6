"""The CPU's caches as benchmarks size their buffers by them (`maru.cli._cpu_caches`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from maru.cli import _cpu_caches
from maru.cli.bench import ARENA_BYTES, arena_bytes

MIB = 2**20


def fake_caches(root: Path, sizes: list[str]) -> Path:
    """A sysfs cache directory of cpu0 with one `indexN/size` per size."""
    for index, size in enumerate(sizes):
        (root / f"index{index}").mkdir(parents=True)
        (root / f"index{index}" / "size").write_text(f"{size}\n")
    return root


def test_the_last_level_cache_is_the_largest_sysfs_names(tmp_path, monkeypatch) -> None:
    caches = fake_caches(tmp_path, ["32K", "32K", "1024K", "98304K"])
    monkeypatch.setattr(_cpu_caches, "CACHES", caches)
    assert _cpu_caches.last_level_cache_bytes() == 96 * MIB


def test_a_machine_whose_linux_names_no_cache_gets_the_stated_guess(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_cpu_caches, "CACHES", tmp_path / "absent")
    assert _cpu_caches.last_level_cache_bytes() == _cpu_caches.UNKNOWN_BYTES


@pytest.mark.parametrize(("text", "expected"), [("48K", 48 << 10), ("2M", 2 * MIB), ("512", 512)])
def test_sysfs_cache_sizes_parse(text: str, expected: int) -> None:
    assert _cpu_caches.parse_cache_size(text) == expected


def test_bench_buffers_outgrow_a_large_last_level_cache(tmp_path, monkeypatch) -> None:
    """`maru bench` asked `os.sysconf` for the L3, a name CPython does not have, and so
    kept 256 MiB buffers on CPUs whose L3 alone is 96 MiB or more."""
    monkeypatch.setattr(_cpu_caches, "CACHES", fake_caches(tmp_path, ["32K", "98304K"]))
    assert arena_bytes() == 4 * 96 * MIB > ARENA_BYTES
