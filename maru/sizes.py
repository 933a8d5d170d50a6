"""Sizes in bytes: parsed from what people write (`4GiB`, `512M`) and formatted for them."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "ki": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mi": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gi": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "ti": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_HELP = "a size such as 4GiB, 4G, 512MiB, 512M or a plain number of bytes"


def parse_size(value: Any) -> int:
    """Bytes from `4GiB`, `4G`, `512M`, `1.5GiB`, `4GB` (decimal) or an integer.

    K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024; KB, MB, GB, TB powers of 1000.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PydanticCustomError("size", f"not a size; allowed: {_SIZE_HELP}")
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match and _SIZE_UNITS.get(match.group(2).lower())
        if not unit:
            raise PydanticCustomError("size", f"not a size; allowed: {_SIZE_HELP}")
        number = match.group(1)
        value = (float(number) if "." in number else int(number)) * unit
    if value != int(value):
        raise PydanticCustomError("size", "not a whole number of bytes; allowed: " + _SIZE_HELP)
    return int(value)


def _positive_size(value: Any) -> int:
    size = parse_size(value)
    if size <= 0:
        raise PydanticCustomError("size", f"must be greater than zero; allowed: {_SIZE_HELP}")
    return size


Size = Annotated[int, BeforeValidator(_positive_size)]
"""A byte count greater than zero, written as an integer or `4GiB`, `512M`, ..."""


def format_size(nbytes: int) -> str:
    """`nbytes` for people: '64 MiB', '1.5 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} byte" if nbytes == 1 else f"{nbytes} bytes"
