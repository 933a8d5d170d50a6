"""Replies to a pipeline of GETs read without the interpreter's lock (maru._respread), as
the Redis store's batched reads use them: each bulk string lands in its buffer, nil,
too-small and error replies are answered per reply, and every failure (deadline,
closed connection, garbage) is an exception, never a wrong byte."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from maru._respread import read_bulks

from maru.backends._redis.wire import Deadline, Reader, TooSmall


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the reader's end, the server's end) of a connected pair; the reader's end times
    out as the store's sockets do (non-blocking underneath)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    yield ours, theirs
    ours.close()
    theirs.close()


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def send_later(sock: socket.socket, pieces: list[bytes], pause: float = 0.0) -> threading.Thread:
    """Send `pieces` from another thread, `pause` seconds apart."""

    def send() -> None:
        for piece in pieces:
            if pause:
                time.sleep(pause)
            sock.sendall(piece)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_each_bulk_lands_in_its_buffer_and_each_reply_is_answered(pair) -> None:
    ours, theirs = pair
    first, second = bytes(range(256)) * 300, b"x" * 10
    theirs.sendall(
        bulk(first) + b"$-1\r\n" + bulk(b"y" * 100) + b"-WRONGTYPE not a string\r\n" + bulk(second)
    )
    outs = [bytearray(len(first)), bytearray(8), bytearray(50), bytearray(8), bytearray(16)]
    replies = read_bulks(ours.fileno(), b"", outs, 5.0, 0.0)
    assert replies == [
        len(first),
        None,
        ("too_small", 100),
        ("error", "WRONGTYPE not a string"),
        len(second),
    ]
    assert outs[0] == first and outs[4][:10] == second


def test_the_request_is_sent_before_its_replies_are_read(pair) -> None:
    ours, theirs = pair
    request = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n" * 2000  # more than a socket buffer

    def answer() -> None:
        received = b""
        while len(received) < len(request):
            received += theirs.recv(1 << 16)
        theirs.sendall(bulk(received[:8]))

    server = threading.Thread(target=answer)
    server.start()
    out = bytearray(8)
    assert read_bulks(ours.fileno(), request, [out], 5.0, 0.0) == [8]
    server.join()
    assert out == request[:8]


def test_a_reply_arriving_in_pieces_is_put_together(pair) -> None:
    ours, theirs = pair
    data = bytes(range(256)) * 64
    stream = bulk(data) + bulk(data[::-1])
    sender = send_later(theirs, [stream[i : i + 1000] for i in range(0, len(stream), 1000)], 0.001)
    outs = [bytearray(len(data)), bytearray(len(data))]
    assert read_bulks(ours.fileno(), b"", outs, 5.0, 0.0) == [len(data), len(data)]
    sender.join()
    assert outs == [data, data[::-1]]


def test_a_server_that_stops_answering_is_a_timeout(pair) -> None:
    ours, theirs = pair
    theirs.sendall(b"$100\r\n" + b"z" * 10)
    with pytest.raises(TimeoutError):
        read_bulks(ours.fileno(), b"", [bytearray(100)], 0.05, 0.0)


def test_the_deadline_grows_with_the_bytes_a_reply_announces(pair) -> None:
    ours, theirs = pair
    sender = send_later(theirs, [b"$1000\r\n", b"a" * 1000 + b"\r\n"], 0.3)
    out = bytearray(1000)
    # 0.2 s would end before the body arrives; 1 ms a byte allows a second more
    assert read_bulks(ours.fileno(), b"", [out], 0.2 + 0.3, 1e-3) == [1000]
    sender.join()


def test_a_connection_closed_mid_reply_is_a_connection_error(pair) -> None:
    ours, theirs = pair
    theirs.sendall(b"$100\r\nabc")
    theirs.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError):
        read_bulks(ours.fileno(), b"", [bytearray(100)], 5.0, 0.0)


@pytest.mark.parametrize(
    "stream",
    [b"+OK\r\n", b"$abc\r\n", b"$3\r\nabcXY", b"$3\r\nabc\r\n$1\r\n"],
    ids=["not a bulk", "a bad size", "a bulk that runs on", "bytes beyond the batch"],
)
def test_what_is_not_a_reply_to_get_is_refused(pair, stream: bytes) -> None:
    ours, theirs = pair
    theirs.sendall(stream)
    with pytest.raises(ValueError):
        read_bulks(ours.fileno(), b"", [bytearray(8)], 0.5, 0.0)


def test_the_reader_maps_replies_and_failures_as_the_store_expects(pair) -> None:
    ours, theirs = pair
    theirs.sendall(bulk(b"abc") + bulk(b"x" * 20) + b"-OOM no memory\r\n" + b"$-1\r\n")
    reader = Reader(ours, Deadline(5.0, 0.0))
    replies = reader.bulks_into([memoryview(bytearray(4)) for _ in range(4)])
    assert replies[:2] == [3, TooSmall(20)] and replies[3] is None
    assert isinstance(replies[2], redis.exceptions.ResponseError)
    theirs.sendall(b"$5\r\nab")
    with pytest.raises(redis.TimeoutError):
        Reader(ours, Deadline(0.05, 0.0)).bulks_into([memoryview(bytearray(5))])


def python_calls_reading(pair, pieces: int) -> int:
    """Python calls made while the reader reads a batch of 8 replies that arrives in
    `pieces` pieces."""
    ours, theirs = pair
    stream = bulk(b"k" * 4096) * 8
    size = -(-len(stream) // pieces)
    sender = send_later(theirs, [stream[i : i + size] for i in range(0, len(stream), size)], 0.0005)
    calls = 0

    def count(frame, event, arg) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    reader = Reader(ours, Deadline(5.0, 0.0))
    outs = [memoryview(bytearray(4096)) for _ in range(8)]
    sys.setprofile(count)
    try:
        replies = reader.bulks_into(outs)
    finally:
        sys.setprofile(None)
    sender.join()
    assert replies == [4096] * 8
    return calls


def test_a_batch_is_read_without_running_python_between_its_system_calls(pair) -> None:
    """What lets a background load read beside the engine's busy thread: however many
    pieces a batch arrives in, reading it runs the same Python code, so the reading
    thread never waits for the interpreter's lock between pieces."""
    assert python_calls_reading(pair, 256) == python_calls_reading(pair, 2)
