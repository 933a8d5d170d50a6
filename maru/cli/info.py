"""`maru info` (plugins, backends, layout adapters, and who provides each; the plugins
that failed to load or are blocked; how this CPU copies KV pages) and `maru config
show|check` (each resolved value and its source; a file validated on its own)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from maru._streamcopy import STREAMING, SUMS_AS_COPIED
from maru.backends.registry import backend_class
from maru.cli.command import Result, add_config_option
from maru.config import ResolvedConfig, leaves, resolve_config, shown_value
from maru.errors import ConfigError
from maru.plugins import UnloadedPlugin, get_plugin_manager, maru_version


def cmd_info(args: argparse.Namespace) -> Result:
    """Version, plugins, backends and layout adapters, with their distributions; the
    plugins that failed to load (maru works without them) and those blocked."""
    try:  # first: the config's `plugins` section decides which plugins load
        config = resolve_config(args.config).config
        backend = backend_class(config.backend)
        configured = {
            "backend": config.backend,
            "detail": backend.describe(config.backend_options()),
        }
    except ConfigError as exc:
        configured = {"error": str(exc)}
    manager = get_plugin_manager()
    data = {
        "version": maru_version(),
        "configured": configured,
        "plugins": [vars(p) for p in manager.plugins()],
        "failed_plugins": [dataclasses.asdict(p) for p in manager.failed()],
        "blocked_plugins": [dataclasses.asdict(p) for p in manager.blocked()],
        "backends": _provided(manager.backends),
        "layout_adapters": _provided(manager.layout_adapters),
        "cpu_copies": {"streaming": bool(STREAMING), "sums_as_copied": bool(SUMS_AS_COPIED)},
    }
    return Result(data, _format_info(data))


def _cpu_copies_line(copies: dict[str, bool]) -> str:
    """How a load into a CPU KV cache copies and verifies here: a CPU without AVX2 pays
    a second pass over each object to check it."""
    stores = "streaming stores" if copies["streaming"] else "memcpy"
    check = (
        "checksums summed as they copy (AVX2)"
        if copies["sums_as_copied"]
        else "checksums summed after each copy (no AVX2: slower verified loads)"
    )
    return f"CPU copies: {stores}; {check}"


def _provided(items: dict) -> list[dict[str, str]]:
    return [
        {
            "name": p.name,
            "distribution": p.plugin.distribution,
            "plugin": p.plugin.name,
            "description": getattr(p.cls, "description", ""),
        }
        for p in items.values()
    ]


def _format_info(data: dict[str, Any]) -> str:
    configured = data["configured"]
    detail = (
        f"{configured['backend']}: {configured['detail']}"
        if "backend" in configured
        else configured["error"]
    )
    lines = [
        f"maru {data['version']}",
        f"configured backend: {detail}",
        _cpu_copies_line(data["cpu_copies"]),
        "plugins:",
    ]
    lines += [f"  {p['name']:<24} {p['distribution']} {p['version']}" for p in data["plugins"]]
    for title, key in (("failed to load", "failed_plugins"), ("blocked", "blocked_plugins")):
        if data[key]:
            lines.append(f"{title}:")
            lines += [f"  {UnloadedPlugin(**p)}" for p in data[key]]
    for title in ("backends", "layout_adapters"):
        lines.append(f"{title.replace('_', ' ')}:")
        lines += [
            f"  {p['name']:<24} {p['distribution']:<24} {p['description']}" for p in data[title]
        ] or ["  (none)"]
    return "\n".join(lines)


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


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    """`maru info` and `maru config show|check`."""
    info = commands.add_parser("info", parents=[common], help="plugins, backends, adapters")
    add_config_option(info)
    info.set_defaults(run=cmd_info)
    config = commands.add_parser("config", help="show or check configuration")
    config_commands = config.add_subparsers(
        dest="config_command", required=True, metavar="SUBCOMMAND"
    )
    show = config_commands.add_parser(
        "show", parents=[common], help="resolved values and their sources"
    )
    add_config_option(show)
    show.set_defaults(run=cmd_config_show)
    check = config_commands.add_parser("check", parents=[common], help="validate a file")
    check.add_argument("file", metavar="FILE")
    check.set_defaults(run=cmd_config_check)
