"""The key schema (`maru.vllm.keys`): every key maru writes parses back into its parts."""

from __future__ import annotations

import pytest

from maru.errors import ConfigError
from maru.vllm import keys

DIGEST = keys.identity_digest({"model": "weights:abc", "block_size": 32})
PREFIX = keys.namespace_prefix("tenant-a", DIGEST)


@pytest.mark.parametrize("block_hash", [bytes(range(32)), b"/@/@" * 8, b"@12", b"\xff" * 32])
def test_a_rank_key_parses_back_into_namespace_hash_and_rank(block_hash) -> None:
    key = keys.rank_key(keys.chunk_key(PREFIX, block_hash), 3)
    parsed = keys.parse_key(key)
    assert (parsed.tenant, parsed.digest, parsed.block_hash, parsed.rank) == (
        "tenant-a",
        DIGEST,
        block_hash,
        3,
    )
    assert parsed.namespace == f"tenant-a/{DIGEST}" and parsed.prefix == PREFIX
    assert not parsed.is_record


@pytest.mark.parametrize("block_hash", [bytes(range(32)), b"@3.1" * 8, b"@0"])
def test_a_group_s_key_parses_back_into_hash_rank_and_group(block_hash) -> None:
    chunk = keys.chunk_key(PREFIX, block_hash)
    parsed = keys.parse_key(keys.rank_key(chunk, 2, group=1))
    assert (parsed.block_hash, parsed.rank, parsed.group) == (block_hash, 2, 1)
    assert keys.parse_key(keys.rank_key(chunk, 2)).group == 0
    assert keys.rank_key(chunk, 2, group=1) != keys.rank_key(chunk, 2)


def test_the_record_key_parses_as_the_namespace_record() -> None:
    parsed = keys.parse_key(keys.record_key(PREFIX))
    assert parsed.is_record and parsed.namespace == f"tenant-a/{DIGEST}"
    assert parsed.block_hash is None and parsed.rank is None


@pytest.mark.parametrize(
    "key",
    [
        b"other/key",
        b"maru/",
        b"maru/t/short/x@0",
        PREFIX + b"no-rank",
        PREFIX + b"hash@x",
        PREFIX + b"hash@0.",
        PREFIX + b"hash@0.g",
        PREFIX + "hash@\u00b2".encode(),
        PREFIX,
    ],
)
def test_keys_of_another_schema_are_not_taken_apart(key) -> None:
    assert keys.parse_key(key) is None


def test_the_digest_covers_every_field_and_ignores_their_order() -> None:
    identity = {"model": "m", "block_size": 32, "tp_size": 1}
    assert keys.identity_digest(identity) == keys.identity_digest(dict(reversed(identity.items())))
    assert keys.identity_digest(identity) != keys.identity_digest(identity | {"tp_size": 2})
    assert len(DIGEST) == keys.DIGEST_CHARS


def test_the_header_ties_an_object_to_its_key_layout_and_size() -> None:
    header = keys.object_header(b"k", "layout", 100)
    assert len(header) == keys.HEADER_BYTES and header.startswith(keys.HEADER_MAGIC)
    others = (
        keys.object_header(b"j", "layout", 100),
        keys.object_header(b"k", "other", 100),
        keys.object_header(b"k", "layout", 101),
    )
    assert all(other != header for other in others)


def test_records_round_trip_and_garbage_reads_as_no_record() -> None:
    record = {"model": "m", "chunk_tokens": 256}
    assert keys.decode_record(keys.encode_record(record)) == record
    assert keys.decode_record(b"not json") == keys.decode_record(b"[1]") == {}
    assert keys.decode_record(None) == {}


def test_a_selection_names_a_tenant_or_one_namespace() -> None:
    assert keys.selection_prefix("tenant-a") == b"maru/tenant-a/"
    assert keys.selection_prefix(f"tenant-a/{DIGEST}") == PREFIX
    for bad in ("", "a//", "a/b/c"):
        with pytest.raises(ConfigError, match=r"--namespace = .*allowed"):
            keys.selection_prefix(bad)
