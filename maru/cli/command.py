"""What every `maru` command shares: its result, exit codes, the --config option."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from maru.backends.base import Backend
from maru.backends.registry import backend_class
from maru.config import MaruConfig

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


@dataclass
class Result:
    """What a command produced: data for --json, text for people."""

    data: Any
    text: str
    exit_code: int = EXIT_OK


def add_config_option(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--config FILE`, as every command that reads maru's configuration takes it."""
    parser.add_argument("--config", metavar="FILE", help=help or "config file (else MARU_CONFIG)")


def open_existing(config: MaruConfig) -> Backend:
    """The configured store, without creating one that does not exist."""
    return backend_class(config.backend).open_existing(config)
