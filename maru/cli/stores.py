"""`maru pool list|gc`: every maru store on this node, who holds each, and the removal
of leaked ones (held by no process: their creators were killed, say)."""

from __future__ import annotations

import argparse
import fnmatch
import re
import time

from maru.backends.node import FoundStore
from maru.backends.registry import backend_classes
from maru.cli.command import Result
from maru.config import resolve_config
from maru.sizes import format_size

DEFAULT_GRACE = "10m"
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """A `--older-than` value in seconds: a number with an optional unit s, m, h or d."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; allowed: a number with an optional unit s, m, h "
            "or d, e.g. 90s, 10m, 2h"
        )
    return float(match[1]) * _UNITS[match[2]]


def find_stores(args: argparse.Namespace) -> list[FoundStore]:
    """The stores every installed backend finds on this node whose names match
    `--name`, each path once (the backend configured for it first: a cxl pool in
    /dev/shm is cxl's, not shm's)."""
    config = resolve_config(args.config).config
    found: dict[str, FoundStore] = {}
    for _, backend in sorted(backend_classes().items(), key=lambda item: item[0] != "cxl"):
        for store in backend.find_stores(config):
            if fnmatch.fnmatchcase(store.name, args.name or "*"):
                found.setdefault(store.path, store)
    return sorted(found.values(), key=lambda store: (store.backend, store.name))


def cmd_list(args: argparse.Namespace) -> Result:
    """Every store maru finds on this node, with its holders and whether it leaked."""
    stores = find_stores(args)
    lines = [line for store in stores for line in _describe(store)]
    leaked = [store for store in stores if store.leaked]
    lines.append(
        f"{len(stores)} stores, {len(leaked)} held by no process "
        f"({format_size(sum(store.capacity or 0 for store in leaked))}); "
        f"'maru pool gc' removes those older than {DEFAULT_GRACE} (--older-than)"
    )
    return Result([store.as_dict() for store in stores], "\n".join(lines))


def cmd_gc(args: argparse.Namespace) -> Result:
    """Remove the stores held by no process and older than `--older-than`."""
    removed: list[FoundStore] = []
    kept: list[dict[str, str]] = []
    for store in find_stores(args):
        why = store.keep_reason(args.older_than)
        if not why and store.remove is None:
            why = "this backend's stores are not removed by maru pool gc"
        if not why and not args.dry_run:
            why = store.remove()
        if why:
            kept.append({"path": store.path, "backend": store.backend, "why": why})
        else:
            removed.append(store)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} {_title(store)}" for store in removed]
    lines += [f"kept {entry['path']}: {entry['why']}" for entry in kept]
    freed = sum(store.capacity or 0 for store in removed)
    lines.append(f"{verb} {len(removed)} stores ({format_size(freed)}), kept {len(kept)}")
    data = {
        "dry_run": args.dry_run,
        "removed": [store.as_dict() for store in removed],
        "kept": kept,
    }
    return Result(data, "\n".join(lines))


def _title(store: FoundStore) -> str:
    size = format_size(store.capacity) if store.capacity is not None else "size unknown"
    return f"{store.backend} {store.name!r} ({store.path}, {size}, owner {store.owner})"


def _describe(store: FoundStore) -> list[str]:
    """A store for people: what it is, then who holds it, then what is odd about it."""
    lines = [_title(store)]
    if store.used is not None:
        lines.append(
            f"    used {format_size(store.used)} in {store.objects} objects, created "
            f"{_when(store.created)}"
        )
    if store.holders:
        lines.extend(f"    held by {holder}" for holder in store.holders)
    elif store.held:
        lines.append("    held by a process of another user (this user cannot see which)")
    elif store.kept_by_design:
        lines.append(f"    {store.kept_by_design}")
    elif store.held is None:
        lines.append(f"    held: cannot tell ({store.why_unknown})")
    else:
        lines.append("    LEAKED: held by no process")
    if store.problem:
        lines.append(f"    problem: {store.problem}")
    return lines


def _when(created: float | None) -> str:
    if created is None:
        return "at an unknown time"
    minutes = (time.time() - created) / 60
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
    return f"{stamp} ({minutes:.0f} min ago)"


def add_arguments(pool: argparse.ArgumentParser) -> None:
    """The options of `maru pool list|gc`."""
    pool.add_argument(
        "--name", metavar="PATTERN", help="list, gc: only stores so named (e.g. 'bench-*')"
    )
    pool.add_argument(
        "--dry-run", action="store_true", help="gc: say what would be removed, remove nothing"
    )
    pool.add_argument(
        "--older-than",
        type=duration,
        default=duration(DEFAULT_GRACE),
        metavar="DURATION",
        help=f"gc: spare stores younger than this (default {DEFAULT_GRACE}; e.g. 90s, 2h, 0)",
    )
