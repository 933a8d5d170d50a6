"""`maru demo`, as a new user runs it: from a fresh home, and with a check that means something."""

from __future__ import annotations

import functools
import mmap

import numpy as np
import pytest

import maru.cli.demo
from maru.backends.shm import SHM_DIR, shm_path
from maru.cli import main
from maru.vllm.keys import HEADER_BYTES, HEADER_MAGIC


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """A home with nothing in it, as on a new machine."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return home


@pytest.mark.slow
def test_the_demo_runs_from_a_fresh_home_and_leaves_no_pool(fresh_home, capsys) -> None:
    pools_before = set(SHM_DIR.glob("maru-*"))
    code = main(["demo", "--prompt-tokens", "600"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "prompt: 513 tokens" in out, "rounded down to whole chunks plus one token"
    assert "tokens engine B loaded from maru: 512" in out
    assert "(512 tokens cached)" in out, "A's own hit has the same length as B's"
    assert "outputs identical (engine B's maru hit vs engine A's own cache hit): True" in out
    assert "each engine's first request (before these, 24 tokens of its own" in out
    assert "objects=3," in out, "the prompt's two chunks and A's record: warm-ups store nothing"
    assert f"capacity={256 * 2**20}," in out, "the demo's own small pool"
    left = set(SHM_DIR.glob("maru-*")) - pools_before
    assert not left, "nothing of the demo left in shared memory (other processes may come and go)"
    assert (fresh_home / ".cache/maru/demo-engines.log").stat().st_size > 0
    assert (fresh_home / ".cache/maru/models/demo-llama/config.json").is_file()


def corrupt_one_chunk(pool: str) -> None:
    """Overwrite the payload of the first stored chunk with random bytes (a stray writer)."""
    with open(shm_path(pool), "r+b") as file, mmap.mmap(file.fileno(), 0) as region:
        start = region.find(HEADER_MAGIC)
        assert start >= 0, "engine A stored no chunk"
        size = int.from_bytes(region[start + 32 : start + 40], "little")
        payload = start + HEADER_BYTES
        noise = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        region[payload : payload + size] = noise.tobytes()


@pytest.mark.slow
def test_the_demo_says_false_and_fails_when_a_stored_chunk_is_corrupted(
    pool_config, tiny_model, monkeypatch, capsys
) -> None:
    """With checksums off, so that the corrupted bytes reach engine B (with them on, the
    chunk is a miss and recomputed: the pool's own tests show that)."""
    monkeypatch.setenv("MARU_SHM__CHECKSUM", "false")
    config, pool = pool_config
    corrupting = functools.partial(
        maru.cli.demo.run_demo,
        model=tiny_model,
        vocab=512,
        after_engine_a=lambda: corrupt_one_chunk(pool),
    )
    monkeypatch.setattr(maru.cli.demo, "run_demo", corrupting)
    code = main(["demo", "--config", config, "--prompt-tokens", "513"])
    out, err = capsys.readouterr()
    assert "tokens engine B loaded from maru: 512" in out, f"the demo failed: {err}"
    assert "outputs identical (engine B's maru hit vs engine A's own cache hit): False" in out
    assert code == 1


def test_a_prompt_shorter_than_a_chunk_is_a_usage_error(pool_config, capsys) -> None:
    config, _ = pool_config
    assert main(["demo", "--config", config, "--prompt-tokens", "100"]) == 2
    assert (
        "prompt_tokens = 100: too short to share a chunk; allowed: at least chunk_tokens "
        "+ 1 = 257" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_the_remote_demo_runs_two_nodes_sharing_only_a_private_redis(fresh_home, capsys) -> None:
    pools_before = set(SHM_DIR.glob("maru-*"))
    code = main(["demo", "--remote", "redis", "--prompt-tokens", "600"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "sharing Redis at redis://127.0.0.1:" in err, "a private server on loopback"
    assert "Redis holds A's 3 objects" in err, "the prompt's two chunks and A's record"
    staged = "(from a slow tier, read into B's pool before vLLM scheduled it)"
    assert f"tokens engine B loaded from maru: 512 {staged}" in out
    assert "outputs identical (engine B's maru hit vs engine A's own cache hit): True" in out
    left = set(SHM_DIR.glob("maru-*")) - pools_before
    assert not left, "neither node's pool is left in shared memory"


@pytest.mark.slow
def test_the_remote_demo_uses_the_configured_redis_and_removes_what_it_stored(
    fresh_home, redis_server, monkeypatch, capsys
) -> None:
    import redis

    monkeypatch.setenv("MARU_REDIS__URL", redis_server.url)
    code = main(["demo", "--remote", "redis", "--prompt-tokens", "600"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert f"sharing Redis at {redis_server.url}" in err
    assert "outputs identical (engine B's maru hit vs engine A's own cache hit): True" in out
    assert redis.Redis.from_url(redis_server.url).keys("maru-demo-*") == []


def test_the_remote_demo_without_redis_server_says_how_to_install_it(
    fresh_home, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["demo", "--remote", "redis"]) == 2
    err = capsys.readouterr().err
    assert "remote = 'redis': redis-server is missing" in err
    assert "apt-get install -y redis-server" in err
