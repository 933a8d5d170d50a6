"""Namespace records: what each instance's keys were made from, kept in the store beside
its objects, so that "why don't my instances share?" has an answer.

A connector's keys are `maru/<namespace>/<digest>/<block hash>@<rank>`, the digest
covering everything that changes a chunk's bytes (`connector.namespace_parts`). Next
to them the scheduler keeps one record, `maru/<namespace>/<digest>/.namespace`: those
parts as JSON, plus the vLLM release, whether the hash seed is shared across
processes, and when the instance was last active. `maru pool namespaces` lists them;
an instance that finds records for its model that differ from its own says which
fields differ. No vLLM import here: the CLI uses this module too.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from maru.backends.base import Backend

RECORD = b".namespace"
"""The last part of a record's key, after the namespace's key prefix."""

NOT_COMPARED = frozenset({"active", "vllm"})
"""Record fields that do not decide whether two instances share."""


def record_key(prefix: bytes) -> bytes:
    """The record's key for the namespace with key prefix `prefix` (`maru/ns/digest/`)."""
    return prefix + RECORD


def write_record(store: Backend, prefix: bytes, record: dict[str, Any]) -> None:
    """Store (or refresh) the record, stamped with the time."""
    key = record_key(prefix)
    store.delete(key)
    store.put(key, json.dumps(record | {"active": time.time()}, sort_keys=True).encode())


def differing_fields(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple]:
    """Fields that keep two namespaces apart: name -> (ours, theirs)."""
    names = (ours.keys() | theirs.keys()) - NOT_COMPARED
    return {name: (ours.get(name), theirs.get(name)) for name in sorted(names)
            if ours.get(name) != theirs.get(name)}


@dataclass
class Namespace:
    """One key prefix found in a store: its objects and its record, if it has one."""

    name: str
    """`<namespace>/<digest>`, as `maru pool clear --namespace` takes it."""
    objects: int = 0
    record: dict[str, Any] = field(default_factory=dict)


def namespaces(store: Backend, other_than: str | None = None) -> list[Namespace]:
    """Every namespace with objects or a record in `store` (but `other_than`, whose record
    is not even read: reads count as the store's hits), most objects first."""
    counts: Counter[str] = Counter()
    records: dict[str, dict[str, Any]] = {}
    for key in store.keys(b"maru/"):
        name = "/".join(key.decode(errors="replace").split("/")[1:3])
        if name == other_than:
            continue
        if key.endswith(b"/" + RECORD):
            records[name] = _decoded(store.get(key))
        else:
            counts[name] += 1
    found = [Namespace(name, counts[name], records.get(name, {}))
             for name in counts.keys() | records.keys()]
    return sorted(found, key=lambda ns: (-ns.objects, ns.name))


def last_active(record: dict[str, Any]) -> str:
    """When the record's instance was last active, in local time ("?" if it never said)."""
    active = record.get("active")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(active)) if active else "?"


def _decoded(data: bytes | None) -> dict[str, Any]:
    try:
        return json.loads(data or b"{}")
    except ValueError:
        return {}
