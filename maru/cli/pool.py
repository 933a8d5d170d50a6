"""`maru pool create|stats|namespaces|clear|destroy`: the configured store, for any
backend that offers the operation (shm and cxl pools offer them all); exit 2 where it
does not. `maru pool list|gc`, every store on the node, are `maru.cli.stores`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from maru.backends.registry import backend_class
from maru.cli import stores
from maru.cli.command import Result, add_config_option, open_existing
from maru.config import resolve_config
from maru.errors import ConfigError, UnsupportedOperationError
from maru.sizes import format_size
from maru.vllm.keys import selection_prefix
from maru.vllm.records import last_active, namespaces

ACTIONS = ("create", "stats", "namespaces", "clear", "destroy", "list", "gc")
NODE_ACTIONS = {"list": stores.cmd_list, "gc": stores.cmd_gc}
RATES = ("hits", "misses", "evictions")


def _open_pool(config_file: str | None, action: str) -> Any:
    """The configured store: created by `create`, else only one that exists."""
    config = resolve_config(config_file).config
    if action == "create":
        return backend_class(config.backend)(config)
    return open_existing(config)


def _pool_report(store: Any) -> dict[str, Any]:
    return store.stats().as_dict() | store.info()


def _format_pool(report: dict[str, Any]) -> str:
    return "\n".join(f"{key:<22} {value}" for key, value in report.items())


def cmd_pool(args: argparse.Namespace) -> Result:
    """Create, inspect, clear or destroy the configured store, for any backend that
    offers the operation (shm and cxl pools offer them all); exit 2 where it does not."""
    if args.namespace is not None and args.action != "clear":
        raise ConfigError(f"--namespace = {args.namespace!r}: only 'maru pool clear' takes it")
    if args.action in NODE_ACTIONS:
        return NODE_ACTIONS[args.action](args)
    prefix = selection_prefix(args.namespace) if args.namespace is not None else None
    with _open_pool(args.config, args.action) as store:
        try:
            return _pool_action(store, args, prefix)
        except UnsupportedOperationError as exc:
            raise ConfigError(
                f"backend = {store.name!r}: maru pool {args.action} "
                f"needs an operation it lacks: {exc}"
            ) from None


def _pool_action(store: Any, args: argparse.Namespace, prefix: bytes | None) -> Result:
    """One `maru pool` action on an open store."""
    if args.action == "destroy":
        label = store.label
        store.destroy()
        return Result({"destroyed": label}, f"destroyed {label}")
    if prefix is not None:
        removed = store.delete_prefix(prefix)
        return Result(
            {"removed": removed, "namespace": args.namespace},
            f"removed {removed} objects of namespace {args.namespace!r} from {store.label}",
        )
    if args.action == "clear":
        removed = store.clear()
        return Result({"removed": removed}, f"removed {removed} objects from {store.label}")
    if args.action == "namespaces":
        return _namespaces_result(store)
    if args.action == "stats" and args.watch:
        return _watch(store, args)
    report = _pool_report(store)
    if args.action == "create":
        report |= _populated(store)
    return Result(report, _format_pool(report))


def _populated(store: Any) -> dict[str, Any]:
    """Wait for the new store's memory to be populated (a progress line on stderr); what
    the memory got, e.g. huge pages or not, populated or not."""

    def progress(done: int, total: int) -> None:
        line = f"populating: {format_size(done)} of {format_size(total)}"
        print(line, file=sys.stderr, flush=True)

    return store.populate(progress)


def _namespaces_result(store: Any) -> Result:
    """The namespaces in the pool: objects, last activity, and what their keys are made of."""
    found = namespaces(store)
    lines = []
    for namespace in found:
        record = dict(namespace.record)
        when = last_active(record)
        record.pop("active", None)
        lines.append(f"{namespace.name}  objects {namespace.objects}  last active {when}")
        lines.extend(f"    {key:<18} {value}" for key, value in sorted(record.items()))
        if not record:
            lines.append("    (no record: written by an instance that keeps none)")
    data = [{"name": ns.name, "objects": ns.objects, "record": ns.record} for ns in found]
    return Result(data, "\n".join(lines) or "no namespaces in the pool")


def watch_line(report: dict[str, Any], rates: dict[str, float]) -> str:
    """One refresh of `pool stats --watch` for people: sizes in KiB/MiB/GiB, rates per
    second, and the hit bandwidth estimated from the mean object size."""
    mean_object = report["used"] / report["objects"] if report["objects"] else 0
    bandwidth = rates["hits"] * mean_object / 1e9
    return (
        f"{time.strftime('%H:%M:%S')}  used {format_size(report['used'])} of "
        f"{format_size(report['capacity'])}  objects {report['objects']}  "
        f"hits {report['hits']} ({rates['hits']:.1f}/s, ~{bandwidth:.2f} GB/s)  "
        f"misses {report['misses']} ({rates['misses']:.1f}/s)  "
        f"evictions {report['evictions']} ({rates['evictions']:.1f}/s)"
    )


def _watch(store: Any, args: argparse.Namespace) -> Result:
    """Refresh the pool's figures every `--watch` seconds: one line rewritten in place
    on a terminal, a line per refresh otherwise, JSON lines with --json."""
    in_place = sys.stdout.isatty() and not args.json
    shown, previous = 0, None
    while args.count is None or shown < args.count:
        if shown:
            time.sleep(args.watch)
        report = _pool_report(store) | {"time": time.time()}
        elapsed = report["time"] - previous["time"] if previous else 0
        rates = {
            f"{name}_per_s": (report[name] - previous[name]) / elapsed if elapsed else 0.0
            for name in RATES
        }
        previous = report
        if args.json:
            print(json.dumps(report | rates), flush=True)
        else:
            line = watch_line(report, {name: rates[f"{name}_per_s"] for name in RATES})
            print(
                f"\x1b[2K\r{line}" if in_place else line, end="" if in_place else "\n", flush=True
            )
        shown += 1
    if in_place:
        print()
    return Result(None, "")


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    """`maru pool ACTION`."""
    pool = commands.add_parser(
        "pool",
        parents=[common],
        help="create, inspect, clear or destroy the configured store; list the stores on "
        "this node, remove leaked ones (gc)",
    )
    pool.add_argument("action", choices=ACTIONS)
    add_config_option(pool)
    pool.add_argument("--watch", type=float, metavar="SECONDS", help="stats: refresh every N s")
    pool.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N")
    pool.add_argument(
        "--namespace",
        metavar="NAME",
        help="clear: only this namespace ('default' or 'default/DIGEST')",
    )
    stores.add_arguments(pool)
    pool.set_defaults(run=cmd_pool)
