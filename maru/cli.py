"""The `maru` command line. Every command takes --json; config errors exit 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import maru
from maru.config import ResolvedConfig, leaves, resolve_config, shown_value
from maru.errors import (
    BackendError,
    ConfigError,
    MaruError,
    PluginError,
    UnsupportedOperationError,
)
from maru.vllm.keys import selection_prefix

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


@dataclass
class Result:
    """What a command produced: data for --json, text for people."""

    data: Any
    text: str
    exit_code: int = EXIT_OK


def cmd_info(args: argparse.Namespace) -> Result:
    """Version, plugins, backends and layout adapters, with their distributions."""
    from maru.plugins import get_plugin_manager, maru_version

    manager = get_plugin_manager()

    def provided(items: dict) -> list[dict[str, str]]:
        return [
            {
                "name": p.name,
                "distribution": p.plugin.distribution,
                "plugin": p.plugin.name,
                "description": getattr(p.cls, "description", ""),
            }
            for p in items.values()
        ]

    try:
        config = resolve_config(args.config).config
        backend = manager.backend(config.backend)
        configured = {
            "backend": config.backend,
            "detail": backend.describe(config.backend_options()),
        }
    except ConfigError as exc:
        configured = {"error": str(exc)}
    data = {
        "version": maru_version(),
        "configured": configured,
        "plugins": [vars(p) for p in manager.plugins()],
        "backends": provided(manager.backends),
        "layout_adapters": provided(manager.layout_adapters),
    }
    lines = [
        f"maru {data['version']}",
        "configured backend: "
        + (
            f"{configured['backend']}: {configured['detail']}"
            if "backend" in configured
            else configured["error"]
        ),
        "plugins:",
    ]
    lines += [f"  {p['name']:<24} {p['distribution']} {p['version']}" for p in data["plugins"]]
    for title in ("backends", "layout_adapters"):
        lines.append(f"{title.replace('_', ' ')}:")
        lines += [
            f"  {p['name']:<24} {p['distribution']:<24} {p['description']}" for p in data[title]
        ] or ["  (none)"]
    return Result(data, "\n".join(lines))


def _shown_sections(resolved: ResolvedConfig) -> dict[str, Any]:
    config = resolved.config
    values = config.model_dump(mode="json", exclude_none=True)
    values[config.backend] = config.backend_options().model_dump(mode="json")
    return values


def cmd_config_show(args: argparse.Namespace) -> Result:
    """Every resolved value and the source it came from."""
    resolved = resolve_config(args.config)
    rows = [
        (".".join(path), shown_value(path, value), resolved.source_of(path))
        for path, value in leaves(_shown_sections(resolved))
    ]
    data = {name: {"value": value, "source": source} for name, value, source in rows}
    width = max(len(name) for name, _, _ in rows)
    text = "\n".join(
        f"{name:<{width}}  {json.dumps(value):<24} {source}" for name, value, source in rows
    )
    return Result(data, text)


def cmd_config_check(args: argparse.Namespace) -> Result:
    """Validate one config file on its own (environment ignored)."""
    config = resolve_config(args.file, env={}).config
    return Result(
        {"file": args.file, "valid": True, "backend": config.backend},
        f"{args.file}: valid (backend {config.backend})",
    )


def cmd_demo(args: argparse.Namespace) -> Result:
    """Two vLLM engines in two processes share a long prompt's KV through maru."""
    from maru.demo import format_report, private_pool, run_demo

    resolved = resolve_config(args.config)
    configured = bool(resolved.sources)
    config = resolved.config if configured else private_pool(resolved.config)
    try:
        report = run_demo(config, prompt_tokens=args.prompt_tokens,
                          progress=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        if not configured:
            with maru.open_store(config) as store:
                store.destroy()
    return Result(report, format_report(report), EXIT_OK if report["identical"] else EXIT_FAILURE)


POOL_ACTIONS = ("create", "stats", "namespaces", "clear", "destroy")


def cmd_doctor(args: argparse.Namespace) -> Result:
    """Would an instance with this config (and vLLM command line) share what the store
    holds? Exit 1 if the store holds namespaces and it would share with none."""
    from maru import doctor

    command = args.vllm_command[1:] if args.vllm_command[:1] == ["--"] else args.vllm_command
    expectation = doctor.expect(args.config, command)
    with _open_existing(expectation.config) as store:
        diagnosis = doctor.diagnose(store, expectation)
    shares = bool(diagnosis.shares_with) or not diagnosis.peers
    return Result(doctor.report(diagnosis), doctor.format_diagnosis(diagnosis),
                  EXIT_OK if shares else EXIT_FAILURE)


def _open_existing(config: Any) -> Any:
    """The configured store, without creating one that does not exist."""
    from maru.plugins import get_plugin_manager

    return get_plugin_manager().backend(config.backend).open_existing(config)


def _open_pool(config_file: str | None, action: str) -> Any:
    """The configured store: created by `create`, else only one that exists."""
    from maru.plugins import get_plugin_manager

    config = resolve_config(config_file).config
    if action == "create":
        return get_plugin_manager().backend(config.backend)(config)
    return _open_existing(config)


def _pool_report(store: Any) -> dict[str, Any]:
    return store.stats().as_dict() | store.info()


def _format_pool(report: dict[str, Any]) -> str:
    return "\n".join(f"{key:<22} {value}" for key, value in report.items())


def cmd_pool(args: argparse.Namespace) -> Result:
    """Create, inspect, clear or destroy the configured store, for any backend that
    offers the operation (shm and cxl pools offer them all); exit 2 where it does not."""
    if args.namespace is not None and args.action != "clear":
        raise ConfigError(f"--namespace = {args.namespace!r}: only 'maru pool clear' takes it")
    prefix = selection_prefix(args.namespace) if args.namespace is not None else None
    with _open_pool(args.config, args.action) as store:
        try:
            return _pool_action(store, args, prefix)
        except UnsupportedOperationError as exc:
            raise ConfigError(f"backend = {store.name!r}: maru pool {args.action} "
                              f"needs an operation it lacks: {exc}") from None


def _pool_action(store: Any, args: argparse.Namespace, prefix: bytes | None) -> Result:
    """One `maru pool` action on an open store."""
    if args.action == "destroy":
        label = store.label
        store.destroy()
        return Result({"destroyed": label}, f"destroyed {label}")
    if prefix is not None:
        removed = store.delete_prefix(prefix)
        return Result({"removed": removed, "namespace": args.namespace},
                      f"removed {removed} objects of namespace {args.namespace!r} "
                      f"from {store.label}")
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
    from maru.sizes import format_size

    def progress(done: int, total: int) -> None:
        line = f"populating: {format_size(done)} of {format_size(total)}"
        print(line, file=sys.stderr, flush=True)

    return store.populate(progress)


def _namespaces_result(store: Any) -> Result:
    """The namespaces in the pool: objects, last activity, and what their keys are made of."""
    from maru.vllm.records import last_active, namespaces

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


RATES = ("hits", "misses", "evictions")


def watch_line(report: dict[str, Any], rates: dict[str, float]) -> str:
    """One refresh of `pool stats --watch` for people: sizes in KiB/MiB/GiB, rates per
    second, and the hit bandwidth estimated from the mean object size."""
    from maru.sizes import format_size

    mean_object = report["used"] / report["objects"] if report["objects"] else 0
    bandwidth = rates["hits"] * mean_object / 1e9
    return (f"{time.strftime('%H:%M:%S')}  used {format_size(report['used'])} of "
            f"{format_size(report['capacity'])}  objects {report['objects']}  "
            f"hits {report['hits']} ({rates['hits']:.1f}/s, ~{bandwidth:.2f} GB/s)  "
            f"misses {report['misses']} ({rates['misses']:.1f}/s)  "
            f"evictions {report['evictions']} ({rates['evictions']:.1f}/s)")


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
        rates = {f"{name}_per_s": (report[name] - previous[name]) / elapsed if elapsed else 0.0
                 for name in RATES}
        previous = report
        if args.json:
            print(json.dumps(report | rates), flush=True)
        else:
            line = watch_line(report, {name: rates[f"{name}_per_s"] for name in RATES})
            print(f"\x1b[2K\r{line}" if in_place else line, end="" if in_place else "\n",
                  flush=True)
        shown += 1
    if in_place:
        print()
    return Result(None, "")


def cmd_bench(args: argparse.Namespace) -> Result:
    """Throughput and latency of installed backends (the configured one by default), as
    ratios to memcpy; with --plot, also a PNG."""
    from maru.bench import backend_class, format_report, run_bench
    from maru.plots import bench_plot, png_destination, require_matplotlib

    plot = None if args.plot is None else png_destination(args.plot)
    if plot is not None:  # checked before minutes of measuring, not after
        require_matplotlib()
    backends = args.backend or [resolve_config(args.config).config.backend]
    for name in backends:  # an unknown name fails before minutes of measuring
        backend_class(name)
    measure: dict[str, Any] = {"config_file": args.config}
    if args.size:
        measure["sizes"] = tuple(args.size)
    if args.capacity:
        measure["capacity"] = args.capacity
    reports = [run_bench(backend, **measure) for backend in backends]
    text = "\n\n".join(format_report(report) for report in reports)
    if plot is not None:
        bench_plot(reports, plot)
        text += f"\n\nplot written to {plot}"
    return Result(reports, text)


def parse_bench_size(text: str) -> int:
    """A `maru bench --size/--capacity` value: a size greater than zero, e.g. 64KiB."""
    from pydantic import TypeAdapter, ValidationError

    from maru.sizes import Size

    try:
        return TypeAdapter(Size).validate_python(text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc.errors()[0]['msg']}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every maru command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser = argparse.ArgumentParser(prog="maru", description="Maru: a KV-cache store for vLLM")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser("info", parents=[common], help="plugins, backends, adapters")
    info.add_argument("--config", metavar="FILE", help="config file (else MARU_CONFIG)")
    info.set_defaults(run=cmd_info)

    config = commands.add_parser("config", help="show or check configuration")
    config_commands = config.add_subparsers(
        dest="config_command", required=True, metavar="SUBCOMMAND"
    )
    show = config_commands.add_parser(
        "show", parents=[common], help="resolved values and their sources"
    )
    show.add_argument("--config", metavar="FILE", help="config file (else MARU_CONFIG)")
    show.set_defaults(run=cmd_config_show)
    check = config_commands.add_parser("check", parents=[common], help="validate a file")
    check.add_argument("file", metavar="FILE")
    check.set_defaults(run=cmd_config_check)

    pool = commands.add_parser("pool", parents=[common],
                               help="create, inspect, clear or destroy the configured store")
    pool.add_argument("action", choices=POOL_ACTIONS)
    pool.add_argument("--config", metavar="FILE", help="config file (else MARU_CONFIG)")
    pool.add_argument("--watch", type=float, metavar="SECONDS", help="stats: refresh every N s")
    pool.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N")
    pool.add_argument("--namespace", metavar="NAME",
                      help="clear: only this namespace ('default' or 'default/DIGEST')")
    pool.set_defaults(run=cmd_pool)

    doctor = commands.add_parser(
        "doctor", parents=[common], help="would an instance share what the store holds?",
        description="Compare the namespace an instance would use with those in the store "
        "and say which field keeps them apart. Give the instance's vLLM command line "
        "after -- to compare everything but the layout (else only maru's own fields).")
    doctor.add_argument("--config", metavar="FILE", help="config file (else MARU_CONFIG)")
    doctor.add_argument("vllm_command", nargs=argparse.REMAINDER, metavar="-- vllm serve ...")
    doctor.set_defaults(run=cmd_doctor)

    bench = commands.add_parser("bench", parents=[common], help="benchmark backends")
    bench.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="installed backend to measure (repeatable; default: the configured one); "
        "`maru info` lists them",
    )
    bench.add_argument("--size", action="append", type=parse_bench_size, metavar="SIZE",
                       help="object size to measure, e.g. 64KiB (repeatable; default "
                       "64 KiB to 32 MiB)")
    bench.add_argument("--capacity", type=parse_bench_size, metavar="SIZE",
                       help="bytes of each store measured (default 1 GiB)")
    bench.add_argument("--config", metavar="FILE",
                       help="config file (else MARU_CONFIG); a backend without a private "
                       "store (e.g. a server) is measured where it names")
    bench.add_argument("--plot", metavar="FILE.png",
                       help="also draw throughput by object size against memcpy as a PNG "
                       "(needs matplotlib: pip install 'maru[plot]')")
    bench.set_defaults(run=cmd_bench)

    demo = commands.add_parser("demo", parents=[common], help="share a prompt prefix's KV")
    demo.add_argument("--config", metavar="FILE", help="config file (else MARU_CONFIG)")
    demo.add_argument("--prompt-tokens", type=int, default=2049, metavar="N",
                      help="length of the shared prompt, rounded down to whole chunks plus "
                      "one token (default 2049)")
    demo.set_defaults(run=cmd_demo)
    return parser


def _failure(args: argparse.Namespace, exc: BaseException, exit_code: int) -> int:
    message = str(exc) if isinstance(exc, MaruError) else f"{type(exc).__name__}: {exc}"
    if getattr(args, "json", False):
        print(json.dumps({"error": {"type": type(exc).__name__, "message": message}}))
    print(f"maru: error: {message}", file=sys.stderr)
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Run one maru command; the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        result = args.run(args)
    except (ConfigError, PluginError) as exc:
        return _failure(args, exc, EXIT_USAGE)
    except BackendError as exc:
        return _failure(args, exc, EXIT_FAILURE)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return _failure(args, exc, EXIT_FAILURE)
    if result.data is not None:
        print(json.dumps(result.data, indent=2) if args.json else result.text)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
