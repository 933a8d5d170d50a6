"""What `benchmarks/hit_cost.py` makes of the engines' times (the engines are `make bench`'s)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def hit_cost() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import hit_cost

        yield hit_cost
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_slow_hits_are_counted_per_engine_over_the_threshold(hit_cost) -> None:
    runs = {
        "own_hit": {"ttft_s": [0.020, 0.021, 0.090, 0.022]},
        "maru_hit": {"ttft_s": [0.024, 0.110, 0.095, 0.031]},
    }
    assert hit_cost.slow_hits(runs, over_ms=30.0) == {"own_hit": 1, "maru_hit": 3}


def test_the_slow_mode_starts_above_the_own_hits_first_quartile(hit_cost) -> None:
    """A bimodal run: a quarter or more of vLLM's own hits are fast, so the threshold sits
    above the fast mode and below the slow one."""
    own = [0.035, 0.038, 0.040, 0.041, 0.120, 0.150, 0.300, 0.110]
    over_ms = hit_cost.slow_mode_over_ms(own)
    assert max(t for t in own if t < 0.1) * 1e3 < over_ms < min(t for t in own if t > 0.1) * 1e3
