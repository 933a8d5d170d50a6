"""The online path: `vllm serve` with maru (engine core in its own process, an API server
in front), several concurrent requests over HTTP, two servers one after the other sharing
one shm pool, each request's tokens compared with a server without maru, and maru's
counters read from the server's /metrics."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from maru.cli._serve import counter
from maru.cli._serve import serve as vllm_serve

pytestmark = pytest.mark.slow

TOKENS, REQUESTS = 300, 6


def prompts() -> list[list[int]]:
    """Prompts of their own (none hits another in vLLM's own cache, whatever the order)."""
    rng = np.random.default_rng(7)
    return [rng.integers(3, 500, TOKENS).tolist() for _ in range(REQUESTS)]


@contextmanager
def serve(model: Path, log: Path, transfer: dict | None):
    """`vllm serve MODEL` in float32 (a hit's tokens then equal a recompute's), token ids
    in and out."""
    options = [
        "--dtype", "float32",
        "--enforce-eager",
        "--skip-tokenizer-init",
        "--max-model-len", "1024",
        "--block-size", "32",
        "--kv-cache-memory-bytes", str(256 * 2**20),
    ]  # fmt: skip
    with vllm_serve(model, log, transfer, options) as url:
        yield url


def completion(url: str, model: Path, prompt: list[int], **fields) -> dict:
    """The server's answer to a greedy completion of 8 tokens (`fields` override)."""
    body = {
        "model": str(model),
        "prompt": [prompt],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def tokens_of(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def all_at_once(send) -> list[list[int]]:
    """`send(prompt)` for every prompt, concurrently; the tokens, request by request."""
    with ThreadPoolExecutor(REQUESTS) as pool:
        return list(pool.map(send, prompts()))


def maru(pool: str, role: str = "kv_both") -> dict:
    """maru over shm pool `pool`, by its registered name, in vLLM role `role`."""
    return {
        "kv_connector": "MaruKVConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "backend": "shm",
            "capacity": "64MiB",
            "chunk_tokens": 64,
            "shm": {"name": pool},
        },
    }


@pytest.fixture(scope="module")
def plain(tiny_model, tmp_path_factory) -> list[list[int]]:
    """Every prompt's tokens from a server without a connector."""
    with serve(tiny_model, tmp_path_factory.mktemp("plain") / "plain.log", None) as url:
        return all_at_once(lambda prompt: tokens_of(completion(url, tiny_model, prompt)))


WHOLE_BLOCKS = REQUESTS * (TOKENS // 32 * 32)
"""Prompt tokens in whole blocks, over every prompt (4 chunks and a 1-block tail each):
what vLLM's own prefix cache would hit."""


def test_two_servers_share_one_pool_request_by_request(tiny_model, pool_names, tmp_path, plain):
    transfer = maru(pool_names())
    with serve(tiny_model, tmp_path / "first.log", transfer) as url:
        first = all_at_once(lambda prompt: tokens_of(completion(url, tiny_model, prompt)))
        assert counter(url, "vllm:maru_chunks_saved_total") > 0
    with serve(tiny_model, tmp_path / "second.log", transfer) as url:
        second = all_at_once(lambda prompt: tokens_of(completion(url, tiny_model, prompt)))
        loaded = counter(url, "vllm:maru_hit_tokens_total")
    assert first == plain
    assert second == plain
    assert loaded == WHOLE_BLOCKS, "every whole block of every prompt"


def test_a_decode_instance_loads_what_its_prefill_instance_stored(
    tiny_model, pool_names, tmp_path, plain
):
    """Prefill/decode: a proxy (here, in the test) sends each prompt to the producer with
    max_tokens=1, and to the consumer with the producer's kv_transfer_params."""
    pool = pool_names()
    with (
        serve(tiny_model, tmp_path / "producer.log", maru(pool, "kv_producer")) as producer,
        serve(tiny_model, tmp_path / "consumer.log", maru(pool, "kv_consumer")) as consumer,
    ):

        def proxy(prompt: list[int]) -> list[int]:
            prefilled = completion(producer, tiny_model, prompt, max_tokens=1)
            named = prefilled["kv_transfer_params"]
            assert named["maru"]["chunks"] == TOKENS // 64
            return tokens_of(completion(consumer, tiny_model, prompt, kv_transfer_params=named))

        decoded = all_at_once(proxy)
        loaded = counter(consumer, "vllm:maru_hit_tokens_total")
        assert counter(consumer, "vllm:maru_chunks_saved_total") == 0, "a consumer never saves"
        assert counter(producer, "vllm:maru_hit_tokens_total") == 0, "a producer does not load"
    assert decoded == plain
    assert loaded == WHOLE_BLOCKS
