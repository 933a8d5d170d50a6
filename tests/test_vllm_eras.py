"""Engines of different vLLM releases on one shm pool: they share exactly when their block
hashes and their pages agree (the key namespace carries no vLLM version).

The other releases run in the virtual environments `make eras` builds
(`tools/vllm_era.py`); this process runs the main environment's release.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from maru.cli._engine import run_engine, run_engine_in
from tests.test_e2e_vllm import HASH_SEED, PROMPTS_A, PROMPTS_B, SHARED, maru_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def era_python(release: str) -> Path:
    """The interpreter of the environment `make eras` built for `release`."""
    python = ROOT / f".venv-vllm-{release}" / "bin" / "maru-python"
    if not python.exists():
        pytest.fail(
            f"{python} is missing: run 'make eras' (it builds the vLLM release "
            "environments these tests run engines in)"
        )
    return python


def differing(a: dict, b: dict) -> set[str]:
    return {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)}


@pytest.fixture
def pool_config(pool_names) -> dict:
    return maru_config("shm", shm={"name": pool_names()})


@pytest.mark.parametrize(
    ("release", "env"),
    [("0.31.0", {}), ("0.28.0", HASH_SEED)],
    ids=["0.31", "0.28-with-PYTHONHASHSEED"],
)
def test_releases_whose_hashes_and_pages_agree_share(tiny_model, pool_config, release, env):
    """0.31 and 0.28 hash blocks like the main environment's 0.32 (0.28 given the same
    PYTHONHASHSEED, its only seed) and lay pages out alike."""
    writer = run_engine_in(
        era_python(release), tiny_model, PROMPTS_A, kv_transfer_config=pool_config, env=env
    )
    reader = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=pool_config, env=env)
    own_hit = run_engine(tiny_model, PROMPTS_A + PROMPTS_B).token_ids[len(PROMPTS_A) :]
    assert (writer.extra["vllm_version"], reader.extra["vllm_version"]) == (release, "0.32.0")
    assert writer.extra["connector"]["identity"] == reader.extra["connector"]["identity"]
    assert reader.external_cached_tokens == [SHARED, 0, 0]
    assert reader.token_ids == own_hit


def test_releases_whose_hashes_or_pages_differ_never_share(tiny_model, pool_config):
    """0.18 hashes like 0.28 but lays pages out K/V first: only the layout in the namespace
    keeps it from loading 0.28's pages. 0.32 without PYTHONHASHSEED seeds its hashes with
    a fixed value, 0.28 with the variable's."""
    writer = run_engine_in(
        era_python("0.28.0"), tiny_model, PROMPTS_A, kv_transfer_config=pool_config, env=HASH_SEED
    )
    assert writer.extra["connector_totals"]["saves"] > 0
    other_pages = run_engine_in(
        era_python("0.18.1"), tiny_model, PROMPTS_B, kv_transfer_config=pool_config, env=HASH_SEED
    )
    other_seed = run_engine(tiny_model, PROMPTS_B, kv_transfer_config=pool_config)
    for reader, differs_in in ((other_pages, {"layout"}), (other_seed, {"hash_seed"})):
        identities = [run.extra["connector"]["identity"] for run in (writer, reader)]
        assert differing(*identities) == differs_in
        assert reader.external_cached_tokens == [0, 0, 0]
        assert reader.extra["connector_totals"]["lookups"] == 3, "it looked, and missed"
