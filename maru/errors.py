"""The exceptions maru raises: one family, so callers can catch `maru.MaruError`."""

from __future__ import annotations


class MaruError(Exception):
    """Base of every error maru raises on purpose."""


class ConfigError(MaruError, ValueError):
    """Bad configuration: names the field, the value, its source and what is allowed."""


class PluginError(MaruError):
    """The installed plugins contradict each other (e.g. two providers of one name)."""


class BackendError(MaruError):
    """The storage backend is broken or unreachable; callers treat it as a miss."""


class InvalidKeyError(MaruError, ValueError):
    """A key that is empty, too long or not bytes/str."""


class ObjectTooLargeError(MaruError, ValueError):
    """An object that can never fit in the store, even when it is empty."""


class BufferTooSmallError(MaruError, ValueError):
    """`get_into` was given a buffer smaller than the object: nothing was copied."""


class UnsupportedOperationError(MaruError):
    """The backend cannot do this at all (e.g. delete by key prefix); retrying won't help."""
