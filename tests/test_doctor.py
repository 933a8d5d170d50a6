"""`maru doctor`: which namespaces in the store an instance would share, and why not.

The comparison against a real engine's record is in test_e2e_vllm.py."""

from __future__ import annotations

import json

import pytest

import maru
from maru.cli import main
from maru.vllm.keys import DIGEST_CHARS, namespace_prefix, rank_key
from maru.vllm.records import write_record

A, B = "a" * DIGEST_CHARS, "b" * DIGEST_CHARS
"""The digests of the two namespaces in the pool."""


@pytest.fixture
def pool(pool_names, monkeypatch):
    """A pool holding two namespaces' records (chunk_tokens 64 and 128), and the
    environment that points maru at it."""
    name = pool_names()
    monkeypatch.setenv("MARU_SHM__NAME", name)
    monkeypatch.setenv("MARU_CAPACITY", "16MiB")
    monkeypatch.setenv("MARU_CHUNK_TOKENS", "64")
    with maru.open_store(backend="shm", capacity="16MiB", shm={"name": name}) as store:
        for digest, chunk_tokens in ((A, 64), (B, 128)):
            write_record(
                store,
                namespace_prefix("default", digest),
                {"namespace": "default", "chunk_tokens": chunk_tokens, "model": "m"},
            )
        store.put(rank_key(namespace_prefix("default", A) + b"chunk", 0), b"kv")
        yield store


def test_without_a_vllm_command_line_it_compares_maru_s_own_fields(pool, capsys) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"default/{A}: 1 objects" in out and "would share" in out
    assert f"default/{B}: 0 objects" in out
    assert "would not share: chunk_tokens is 64 here, 128 there" in out
    assert f"=> would share with default/{A} (1 objects)" in out
    assert "needs the vLLM command line, after --): block_size, dtype" in out


def test_it_exits_1_when_it_would_share_with_none(pool, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MARU_CHUNK_TOKENS", "256")
    assert main(["doctor", "--json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert found["shares_with"] == []
    assert {ns["name"]: ns["differs"] for ns in found["namespaces"]} == {
        f"default/{A}": {"chunk_tokens": {"here": 256, "there": 64}},
        f"default/{B}": {"chunk_tokens": {"here": 256, "there": 128}},
    }


def test_another_tenant_is_the_field_that_differs(pool, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MARU_NAMESPACE", "tenant-b")
    assert main(["doctor"]) == 1
    assert "namespace is 'tenant-b' here, 'default' there" in capsys.readouterr().out


@pytest.mark.platform
def test_a_bad_vllm_command_line_is_a_usage_error(pool, capsys) -> None:
    assert main(["doctor", "--", "vllm", "serve", "m", "--block-size", "x"]) == 2
    err = capsys.readouterr().err
    assert "vLLM command line: argument --block-size: invalid int value: 'x'" in err


def test_a_pool_that_does_not_exist_is_not_created(pool_names, monkeypatch, capsys) -> None:
    name = pool_names()
    monkeypatch.setenv("MARU_SHM__NAME", name)
    assert main(["doctor"]) == 1
    assert f"shm pool '{name}'" in capsys.readouterr().err
    from maru.backends.shm import shm_path

    assert not shm_path(name).exists()


def test_a_vllm_that_cannot_configure_this_machine_is_named(pool, monkeypatch, capsys) -> None:
    from vllm.engine.arg_utils import EngineArgs

    def no_platform(parser):
        raise RuntimeError("Failed to infer device type")

    monkeypatch.setattr(EngineArgs, "add_cli_args", staticmethod(no_platform))
    assert main(["doctor", "--", "vllm", "serve", "m"]) == 1
    err = capsys.readouterr().err
    assert (
        "cannot build its configuration on this machine (RuntimeError: Failed to infer "
        "device type); run maru doctor where the instance runs" in err
    )
