"""What every `maru` command shares: its result, exit codes, the --config option."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from maru.backends.base import Backend
from maru.backends.registry import backend_class
from maru.config import MaruConfig
from maru.sizes import format_size

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
    """The configured store, without creating one that does not exist; a note on stderr
    where it has another capacity than the configured one (which only a store's creator
    uses)."""
    store = backend_class(config.backend).open_existing(config)
    actual = store.stats().capacity
    if actual != config.capacity:
        print(
            f"note: {store.label} has capacity {format_size(actual)} (configured: "
            f"{format_size(config.capacity)}, which applies only to creating it); using "
            "the store as it is",
            file=sys.stderr,
        )
    return store
