"""Namespace records: what each namespace's keys were made from, kept in the store beside
its objects, so that "why don't my instances share?" has an answer.

The scheduler half keeps one record per namespace (`maru.vllm.keys.record_key`): the
identity its key digest covers (`maru.vllm.identity`), plus the vLLM release, whether
the hash seed is shared across processes, and when an instance was last active. `maru
pool namespaces` and `maru doctor` list them; an instance that finds records of its
model that differ from its own says which fields differ. No vLLM or torch here.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from maru.backends.base import Backend
from maru.log import get_logger
from maru.vllm.keys import ROOT, decode_record, encode_record, parse_key, record_key

log = get_logger(__name__)

NOT_COMPARED = frozenset({"active", "vllm"})
"""Record fields that do not decide whether two instances share."""


def write_record(store: Backend, prefix: bytes, record: dict[str, Any]) -> None:
    """Store (or refresh) the record of the namespace `prefix`, stamped with the time."""
    key = record_key(prefix)
    store.delete(key)
    store.put(key, encode_record(record | {"active": time.time()}))


def differing_fields(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple]:
    """Fields that keep two namespaces apart: name -> (ours, theirs)."""
    names = (ours.keys() | theirs.keys()) - NOT_COMPARED
    return {
        name: (ours.get(name), theirs.get(name))
        for name in sorted(names)
        if ours.get(name) != theirs.get(name)
    }


@dataclass
class Namespace:
    """One namespace found in a store: its objects and its record, if it has one."""

    name: str
    """`<tenant>/<digest>`, as `maru pool clear --namespace` takes it."""
    objects: int = 0
    record: dict[str, Any] = field(default_factory=dict)


def namespaces(store: Backend, other_than: str | None = None) -> list[Namespace]:
    """Every namespace with objects or a record in `store` (but `other_than`, whose record
    is not even read: reads count as the store's hits), most objects first."""
    counts: Counter[str] = Counter()
    records: dict[str, dict[str, Any]] = {}
    for key in store.keys(ROOT):
        parsed = parse_key(key)
        if parsed is None or parsed.namespace == other_than:
            continue
        if parsed.is_record:
            records[parsed.namespace] = decode_record(store.get(key))
        else:
            counts[parsed.namespace] += 1
    found = [
        Namespace(name, counts[name], records.get(name, {}))
        for name in counts.keys() | records.keys()
    ]
    return sorted(found, key=lambda ns: (-ns.objects, ns.name))


def last_active(record: dict[str, Any]) -> str:
    """When the record's instance was last active, in local time ("?" if it never said)."""
    active = record.get("active")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(active)) if active else "?"


def say_how_peers_differ(store: Backend, this: str, record: dict[str, Any]) -> None:
    """Warn, per namespace of the same model in the store, why this one (`this`, whose
    record is `record`) will not share with it."""
    for peer in namespaces(store, other_than=this):
        if peer.record.get("model") != record["model"]:
            continue
        fields = differing_fields(record, peer.record)
        log.warning(
            "maru: this instance will not share with namespace %s (%d objects, same model): %s",
            peer.name,
            peer.objects,
            "; ".join(
                f"{field} is {ours!r} here, {theirs!r} there"
                for field, (ours, theirs) in fields.items()
            ),
        )
