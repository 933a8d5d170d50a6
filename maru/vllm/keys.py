"""The key schema: every key and object header maru writes is built and parsed here.

    maru/<tenant>/<digest>/<block hash>@<rank>    one worker's share of a chunk (its rank:
                                                  pp_rank * tp_size + tp_rank)
    maru/<tenant>/<digest>/<block hash>@<rank>.<group>    the same, of KV cache group > 0
    maru/<tenant>/<digest>/.namespace             the namespace's record (JSON)

`<tenant>` is the configured `namespace` (tenants sharing a store); `<digest>` covers
everything that changes a chunk's bytes (`maru.vllm.identity`), so `<tenant>/<digest>`
names one namespace; `<block hash>` is vLLM's hash of the chunk's last block (raw bytes;
block hashes are chained, so it names the whole prefix). Every chunk object starts with a
HEADER_BYTES header that ties it to its key and layout. No vLLM or torch here: the `maru`
command reads keys too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from maru.errors import ConfigError

ROOT = b"maru/"
RECORD_NAME = b".namespace"
DIGEST_CHARS = 32
RANK_SEPARATOR = b"@"
GROUP_SEPARATOR = "."
HEADER_BYTES = 64
HEADER_MAGIC = b"MARUKV01"


def identity_digest(identity: Mapping[str, Any]) -> str:
    """The digest of a namespace's identity (sorted JSON, SHA-256, DIGEST_CHARS hex)."""
    text = json.dumps(dict(identity), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def namespace_prefix(tenant: str, digest: str) -> bytes:
    """`maru/<tenant>/<digest>/`: the prefix of every key of one namespace."""
    return ROOT + f"{tenant}/{digest}/".encode()


def chunk_key(prefix: bytes, block_hash: bytes) -> bytes:
    """A chunk's key in a namespace: named by the hash of its last block."""
    return prefix + bytes(block_hash)


def rank_key(chunk: bytes, rank: int, group: int = 0) -> bytes:
    """The object key of one tensor-parallel rank's share of a chunk, of one KV cache
    group (`<rank>` for the first group, `<rank>.<group>` for the others)."""
    share = str(rank) if group == 0 else f"{rank}{GROUP_SEPARATOR}{group}"
    return chunk + RANK_SEPARATOR + share.encode()


def record_key(prefix: bytes) -> bytes:
    """The key of the record of the namespace with key prefix `prefix`."""
    return prefix + RECORD_NAME


def encode_record(record: Mapping[str, Any]) -> bytes:
    """A namespace record as stored: JSON with sorted keys."""
    return json.dumps(dict(record), sort_keys=True).encode()


def decode_record(data: bytes | None) -> dict[str, Any]:
    """A stored namespace record; empty if absent or not a JSON object."""
    try:
        record = json.loads(data or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def object_header(key: bytes, layout: str, payload_bytes: int) -> bytes:
    """What a worker checks before trusting an object: magic, key and layout, size."""
    digest = hashlib.sha256(key + b"|" + layout.encode()).digest()[:24]
    header = HEADER_MAGIC + digest + payload_bytes.to_bytes(8, "little")
    return header.ljust(HEADER_BYTES, b"\0")


@dataclass(frozen=True)
class ParsedKey:
    """A maru key taken apart."""

    tenant: str
    digest: str
    name: bytes
    """What follows the namespace's prefix: a rank's share of a chunk, or the record."""

    @property
    def namespace(self) -> str:
        """`<tenant>/<digest>`, as `maru pool namespaces` shows it and `clear` takes it."""
        return f"{self.tenant}/{self.digest}"

    @property
    def prefix(self) -> bytes:
        return namespace_prefix(self.tenant, self.digest)

    @property
    def is_record(self) -> bool:
        return self.name == RECORD_NAME

    @property
    def block_hash(self) -> bytes | None:
        """The chunk's last block hash; None for the record."""
        return None if self.is_record else self.name.rpartition(RANK_SEPARATOR)[0]

    @property
    def rank(self) -> int | None:
        """The tensor-parallel rank whose share this is; None for the record."""
        return None if self.is_record else _share(self.name)[0]

    @property
    def group(self) -> int | None:
        """The KV cache group whose pages this is; None for the record."""
        return None if self.is_record else _share(self.name)[1]


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _share(name: bytes) -> tuple[int, int] | None:
    """(rank, group) of a chunk object's name; None if it does not end in one."""
    share = name.rpartition(RANK_SEPARATOR)[2].decode("ascii", "replace")
    rank, separator, group = share.partition(GROUP_SEPARATOR)
    if not _number(rank) or (separator and not _number(group)):
        return None
    return int(rank), int(group or 0)


def parse_key(key: bytes) -> ParsedKey | None:
    """The parts of a key this schema built; None for any other key."""
    if not key.startswith(ROOT):
        return None
    tenant, _, rest = key[len(ROOT) :].partition(b"/")
    digest, slash, name = rest.partition(b"/")
    if not (tenant and slash and name) or len(digest) != DIGEST_CHARS:
        return None
    if name != RECORD_NAME:
        block_hash, separator, _ = name.rpartition(RANK_SEPARATOR)
        if not (block_hash and separator and _share(name)):
            return None
    try:
        return ParsedKey(tenant.decode(), digest.decode(), name)
    except UnicodeDecodeError:
        return None


def selection_prefix(namespace: str) -> bytes:
    """The key prefix of what `namespace` names: a tenant (`default`) or one namespace
    (`default/DIGEST`, as `maru pool namespaces` lists it)."""
    parts = namespace.split("/")
    if not all(parts) or len(parts) > 2:
        raise ConfigError(
            f"--namespace = {namespace!r}: allowed: a config namespace such as "
            "'default', or 'NAMESPACE/DIGEST' for one model's keys in it"
        )
    return ROOT + f"{namespace}/".encode()
