"""What the Backend contract accepts as keys and buffers, turned into what backends take:
keys as bytes (a str is UTF-8 encoded), buffers as flat byte memoryviews (bytes,
bytearray, numpy arrays, CPU torch tensors), with errors that say what is allowed."""

from __future__ import annotations

import sys
from typing import Any

from maru.errors import InvalidKeyError

MAX_KEY_BYTES = 512
"""Longest key any backend accepts, in bytes (UTF-8 for str keys)."""

Key = bytes | str


def normalize_key(key: Key) -> bytes:
    """The key as bytes, or InvalidKeyError saying what is allowed."""
    if isinstance(key, str):
        key = key.encode("utf-8")
    elif isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    elif not isinstance(key, bytes):
        raise InvalidKeyError(f"key must be bytes or str, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidKeyError(f"key is {len(key)} bytes long; allowed: 1 to {MAX_KEY_BYTES} bytes")
    return key


def byte_view(buffer: Any, *, writable: bool = False) -> memoryview:
    """A flat byte memoryview of bytes, bytearray, numpy arrays or CPU torch tensors."""
    if type(buffer).__module__.startswith("torch"):
        buffer = _tensor_as_numpy(buffer)
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(
            f"expected a buffer (bytes, bytearray, numpy array, CPU torch tensor), "
            f"got {type(buffer).__name__}"
        ) from None
    if not view.contiguous:
        raise ValueError("buffer must be contiguous")
    if writable and view.readonly:
        raise TypeError(f"buffer of type {type(buffer).__name__} is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _tensor_as_numpy(tensor: Any) -> Any:
    torch = sys.modules["torch"]
    if tensor.device.type != "cpu":
        raise TypeError(f"tensor must be on the CPU, it is on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()
