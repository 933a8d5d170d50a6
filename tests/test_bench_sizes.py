"""`maru bench` works at every object size it accepts, on any capacity: it sizes the
objects it reads back (its working set) from what the store holds at once, by
capacity and by entries, says so, and refuses up front a size that cannot fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from maru.backends._pool.region import Geometry
from maru.backends.shm import shm_path
from maru.cli import main
from maru.cli.bench import format_report
from maru.cli.working_set import MAX_WORKING_SET
from tests.conftest import unique_name

MIB = 2**20
CAPACITY = 64 * MIB
SMALL = ("--size", "4KiB", "--capacity", "64MiB")


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    """Run `maru bench --json`: (exit code, the one backend's report, stderr)."""
    code = main(["bench", *argv, "--json"])
    out, err = capsys.readouterr()
    (report,) = json.loads(out)
    return code, report, err


def test_4kib_objects_on_a_64mib_pool_are_bounded_by_its_entries(capsys) -> None:
    """64 MiB holds 16,383 objects of 4 KiB, but the pool's table has fewer entries."""
    entries = Geometry.for_capacity(CAPACITY).entries
    code, report, err = bench(capsys, "--backend", "shm", *SMALL)
    assert code == 0, err
    (row,) = report["sizes"]
    assert row["working_set"] == {
        "objects": entries // 4,
        "holds": entries,
        "bound": "entries",
        "entries": entries,
        "capacity": CAPACITY,
    }
    assert (
        f"working set {entries // 4} objects of 4 KiB: bounded by the store's {entries} entries"
        in format_report(report)
    )


def test_an_object_close_to_the_capacity_reads_the_one_just_written(capsys) -> None:
    """No older object survives a put of 60 MiB into 64 MiB."""
    code, report, err = bench(capsys, "--backend", "shm", "--size", "60MiB", "--capacity", "64MiB")
    assert code == 0, err
    working_set = report["sizes"][0]["working_set"]
    assert (working_set["objects"], working_set["holds"], working_set["bound"]) == (
        0,
        1,
        "capacity",
    )
    assert "working set 1 object of 60 MiB, the one just written" in format_report(report)


def test_tiny_objects_are_bounded_by_the_benchmarks_limit(capsys) -> None:
    code, report, err = bench(capsys, "--backend", "mock", "--size", "1", "--capacity", "16MiB")
    assert code == 0, err
    working_set = report["sizes"][0]["working_set"]
    assert (working_set["objects"], working_set["bound"]) == (MAX_WORKING_SET, "limit")


def test_a_tiered_store_is_bounded_by_its_first_tiers_entries(capsys, tmp_path: Path) -> None:
    pool = unique_name("bench")
    config = tmp_path / "maru.yaml"
    config.write_text(
        f"tiered: {{tiers: [shm, disk]}}\nshm: {{name: {pool}}}\n"
        f"disk: {{path: {tmp_path / 'disk'}}}\n"
    )
    try:
        code, report, err = bench(capsys, "--backend", "tiered", *SMALL, "--config", str(config))
    finally:
        shm_path(pool).unlink(missing_ok=True)
    assert code == 0, err
    working_set = report["sizes"][0]["working_set"]
    entries = Geometry.for_capacity(CAPACITY).entries
    assert (working_set["objects"], working_set["bound"]) == (entries // 4, "entries")


@pytest.mark.parametrize("size", ["64MiB", "1GiB"])
def test_a_size_that_cannot_fit_is_refused_before_measuring(capsys, size: str) -> None:
    code = main(["bench", "--backend", "shm", "--size", size, "--capacity", "64MiB"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "does not fit in a store of --capacity 64 MiB" in err
    assert "shm:" not in err, "nothing was measured"
