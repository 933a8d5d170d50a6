"""The wire path: commands pipelined on one pooled connection, one round trip per batch,
with replies read straight into the callers' buffers.

redis-py builds a `bytes` for every reply, which a caller with a buffer then copies
again; here a reply's bytes go from the socket into the buffer (`recv_into`). The
connection comes from redis-py's pool, connected, authenticated and checked clean
(`ensure_connection` reconnects one with unread data), so the socket holds nothing but
the replies to what is sent here. Every exchange has a `Deadline` that grows with the
bytes it moves; a connection that fails or runs out of time mid-exchange is closed,
never reused half-read. Errors are redis-py's, so the caller maps them in one place.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, TypeVar

import redis
from redis._parsers.base import BaseParser

from maru._respread import read_bulks

SCRATCH_BYTES = 1 << 16
"""Bytes read at a time for reply headers and small replies."""
CHUNKED_READ_BYTES = 16 << 20
"""Buffers this large are read in ranges (`read_many_into`)."""
CHUNK_BYTES = 1 << 20
"""Bytes per range of a chunked read."""

T = TypeVar("T")


class TooSmall(NamedTuple):
    """A reply that did not fit its buffer (nothing was copied into it): its size."""

    size: int


class Deadline:
    """When an exchange must be done: `seconds` from now plus `per_byte` for every byte
    it moves, known up front or learnt from reply headers (`extend`)."""

    __slots__ = ("at", "per_byte")

    def __init__(self, seconds: float, per_byte: float, nbytes: int = 0) -> None:
        self.at = time.monotonic() + seconds + nbytes * per_byte
        self.per_byte = per_byte

    def extend(self, nbytes: int) -> None:
        """Allow for `nbytes` more."""
        self.at += nbytes * self.per_byte

    def left(self) -> float:
        """Seconds left, or redis.TimeoutError once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise redis.TimeoutError("Timeout: the call's deadline passed")
        return left


class Reader:
    """RESP2 replies from a socket, each read once, in order, after the commands they
    answer (`unsent`) are sent: where its replies are read (in Python, or with them in
    `bulks_into`)."""

    def __init__(self, sock: socket.socket, deadline: Deadline, unsent: Sequence[Any] = ()) -> None:
        self._sock = sock
        self._deadline = deadline
        self._unsent = list(unsent)
        self._buffer = bytearray(SCRATCH_BYTES)
        self._start = self._end = 0

    def value(self) -> Any:
        """The next reply: bytes, int, None (nil), a list, or the error it is (returned,
        not raised, so that the replies after it are still read)."""
        kind, rest = self._header()
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            data = bytearray(size)
            self._deadline.extend(size)
            self._exactly(memoryview(data))
            self._end_of_bulk()
            return bytes(data)
        if kind == b"*":
            return None if int(rest) < 0 else [self.value() for _ in range(int(rest))]
        return self._simple(kind, rest)

    def bulk_into(self, out: memoryview) -> int | TooSmall | redis.RedisError | None:
        """The next reply, a bulk string, copied into `out`: its size, None (nil), TooSmall
        (the bytes were read and dropped), or the error it is."""
        kind, rest = self._header()
        if kind != b"$":
            return self._simple(kind, rest)
        size = int(rest)
        if size < 0:
            return None
        self._deadline.extend(size)
        if size > out.nbytes:
            self._exactly(memoryview(bytearray(size)))
            self._end_of_bulk()
            return TooSmall(size)
        self._exactly(out[:size])
        self._end_of_bulk()
        return size

    def bulks_into(self, outs: list[memoryview]) -> list[int | TooSmall | Exception | None]:
        """The next replies, one per buffer, as `bulk_into`. On a plain TCP or Unix socket
        they are read in one call that holds no interpreter lock (`maru._respread`): a
        thread reading beside a busy one (a background load beside the engine) would
        otherwise wait for the lock after each system call. TLS reads in Python."""
        if isinstance(self._sock, ssl.SSLSocket) or self._end > self._start:
            return [self.bulk_into(out) for out in outs]
        request, self._unsent = b"".join(self._unsent), []
        try:
            replies = read_bulks(
                self._sock.fileno(), request, outs, self._deadline.left(), self._deadline.per_byte
            )
        except TimeoutError:
            raise redis.TimeoutError("Timeout reading from socket") from None
        except ValueError as exc:
            raise redis.exceptions.InvalidResponse(f"Protocol error: {exc}") from None
        except OSError as exc:
            raise redis.ConnectionError(f"Error while reading from socket: {exc}") from None
        return [_native(reply) for reply in replies]

    def chunked_into(self, out: memoryview, ranges: int) -> int | TooSmall | Exception | None:
        """The replies to `read_many_into`'s chunked commands, the object copied into `out`:
        its size, None (no such key), TooSmall, or the error it is."""
        queued = [self.value() for _ in range(ranges + 3)]
        kind, rest = self._header()
        if kind != b"*":
            errors = [reply for reply in queued if isinstance(reply, Exception)]
            return errors[0] if errors else self._simple(kind, rest)
        exists, size = self.value(), self.value()
        if not exists or size > out.nbytes:
            for _ in range(ranges):
                self.value()
            return None if not exists else TooSmall(size)
        done = 0
        for _ in range(ranges):
            got = self.bulk_into(out[done:])
            if not isinstance(got, int):
                return got
            done += got
        if done != size:
            raise redis.exceptions.InvalidResponse(f"ranges of {done} bytes, object of {size}")
        return done

    def _simple(self, kind: bytes, rest: bytes) -> Any:
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            return BaseParser.parse_error(rest.decode(errors="replace"))
        if kind == b"_":
            return None
        raise redis.exceptions.InvalidResponse(f"Protocol error: {kind + rest!r}")

    def _header(self) -> tuple[bytes, bytes]:
        """The next line, split into its type byte and the rest."""
        while (end := self._buffer.find(b"\r\n", self._start, self._end)) < 0:
            self._fill()
        line = bytes(self._buffer[self._start : end])
        self._start = end + 2
        return line[:1], line[1:]

    def _exactly(self, out: memoryview) -> None:
        """Fill `out` with the next bytes: what is buffered, then straight from the socket."""
        have = min(self._end - self._start, out.nbytes)
        out[:have] = self._buffer[self._start : self._start + have]
        self._start += have
        while have < out.nbytes:
            have += self._recv_into(out[have:])

    def _end_of_bulk(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._buffer[self._start : self._start + 2] != b"\r\n":
            raise redis.exceptions.InvalidResponse("Protocol error: a bulk string runs on")
        self._start += 2

    def _fill(self) -> None:
        """Read more after what is buffered, moved to the front (growing for long lines)."""
        del self._buffer[: self._start]
        self._end -= self._start
        self._start = 0
        if len(self._buffer) < self._end + SCRATCH_BYTES:
            self._buffer.extend(bytes(self._end + SCRATCH_BYTES - len(self._buffer)))
        self._end += self._recv_into(memoryview(self._buffer)[self._end :])

    def _recv_into(self, out: memoryview) -> int:
        for part in self._unsent:
            self._sock.settimeout(self._deadline.left())
            _send(self._sock, part)
        self._unsent = []
        self._sock.settimeout(self._deadline.left())
        try:
            received = self._sock.recv_into(out)
        except TimeoutError:
            raise redis.TimeoutError("Timeout reading from socket") from None
        except OSError as exc:
            raise redis.ConnectionError(f"Error while reading from socket: {exc}") from None
        if received == 0:
            raise redis.ConnectionError("Connection closed by server.")
        return received


def _native(reply: Any) -> int | TooSmall | Exception | None:
    """`read_bulks`'s answer for one reply, as `bulk_into` gives it."""
    if not isinstance(reply, tuple):
        return reply
    kind, detail = reply
    return TooSmall(detail) if kind == "too_small" else BaseParser.parse_error(detail)


def read_many_into(
    names: list[bytes], outs: list[memoryview], chunked: bool
) -> tuple[list[tuple[Any, ...]], Callable[[Reader], list[Any]]]:
    """The commands that read each object of `names` into its buffer of `outs`, and how
    to read their replies (each object's size, None, TooSmall or an error): one GET each;
    or, where `chunked` and a buffer is large, the object's existence, size and
    CHUNK_BYTES ranges inside MULTI/EXEC (one version of the object), which Redis 7
    sends about twice as fast as one large reply."""
    if not chunked or all(out.nbytes < CHUNKED_READ_BYTES for out in outs):
        return [("GET", name) for name in names], lambda reader: reader.bulks_into(outs)
    commands: list[tuple[Any, ...]] = []
    reads: list[Callable[[Reader], Any]] = []
    for name, out in zip(names, outs, strict=True):
        if out.nbytes < CHUNKED_READ_BYTES:
            commands.append(("GET", name))
            reads.append(partial(Reader.bulk_into, out=out))
            continue
        ranges = [
            ("GETRANGE", name, start, min(start + CHUNK_BYTES, out.nbytes) - 1)
            for start in range(0, out.nbytes, CHUNK_BYTES)
        ]
        commands += [("MULTI",), ("EXISTS", name), ("STRLEN", name), *ranges, ("EXEC",)]
        reads.append(partial(Reader.chunked_into, out=out, ranges=len(ranges)))
    return commands, lambda reader: [read(reader) for read in reads]


def exchange(
    pool: Any,
    commands: Sequence[tuple[Any, ...]],
    read: Callable[[Reader], T],
    start: Callable[[], Deadline],
) -> T:
    """Send `commands` at once on one connection of `pool` and `read` their replies,
    by the deadline `start()` sets once the connection is there (waiting for one is
    bounded by the pool's own timeout)."""
    connection = pool.get_connection()
    try:
        deadline = start()
        return read(Reader(connection._sock, deadline, connection.pack_commands(commands)))
    except BaseException:
        connection.disconnect()
        raise
    finally:
        if connection._sock is not None:
            connection._sock.settimeout(connection.socket_timeout)
        pool.release(connection)


def _send(sock: socket.socket, data: Any) -> None:
    try:
        sock.sendall(data)
    except TimeoutError:
        raise redis.TimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        raise redis.ConnectionError(f"Error while writing to socket: {exc}") from None
