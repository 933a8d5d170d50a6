"""The `maru` command line: info, config, pool, doctor, bench, demo.

Each command is a module of this package that registers its own arguments
(`register`) and returns a `Result`. Every command takes --json; configuration and
usage errors exit 2 with one paragraph saying what is wrong, never a traceback. No
command imports torch or vLLM unless it runs an engine (`demo`) or is given a vLLM
command line (`doctor -- vllm serve ...`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from maru.cli import bench, demo, doctor, info, pool
from maru.cli.command import EXIT_FAILURE, EXIT_USAGE
from maru.errors import BackendError, ConfigError, MaruError, PluginError
from maru.log import get_logger

COMMANDS = (info, pool, doctor, bench, demo)
"""The command modules, in the order `maru --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every maru command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser = argparse.ArgumentParser(prog="maru", description="Maru: a KV-cache store for vLLM")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands, common)
    return parser


def _failure(args: argparse.Namespace, exc: BaseException, exit_code: int) -> int:
    message = str(exc) if isinstance(exc, MaruError) else f"{type(exc).__name__}: {exc}"
    if getattr(args, "json", False):
        print(json.dumps({"error": {"type": type(exc).__name__, "message": message}}))
    print(f"maru: error: {message}", file=sys.stderr)
    return exit_code


def _show_plugin_log() -> None:
    """The plugin manager's lines on stderr: plugins that failed to load, and every hook
    call with MARU_PLUGINS_TRACE (a command configures no other logging)."""
    logger = get_logger("maru.plugins")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("maru: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM unwinds like an exception, so a command's private stores (`maru bench`,
    `maru demo`) are destroyed on the way out instead of leaking in /dev/shm."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one maru command; the process exit code."""
    args = build_parser().parse_args(argv)
    _show_plugin_log()
    if threading.current_thread() is not threading.main_thread():
        return _run(args)  # only the main thread may handle signals
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; the process exit code."""
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
        _print(json.dumps(result.data, indent=2) if args.json else result.text)
    return result.exit_code


def _print(text: str) -> None:
    """Print to stdout; a reader that went away (`maru info | head`) is no error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
