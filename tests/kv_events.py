"""A subscriber to vLLM's KV event publisher, for tests that follow what a router sees."""

from __future__ import annotations


def subscribe_to_kv_events(endpoint: str):
    """A ZMQ subscriber to vLLM's KV event publisher at `endpoint` (an ipc:// one, which
    the publisher binds; the subscriber may connect first), and a monitor of its
    connection (`wait_until_connected`)."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    socket.connect(endpoint)
    return socket, monitor


def wait_until_connected(socket, monitor, timeout_s: float = 120.0) -> None:
    """Wait for the subscriber's handshake with the publisher: its subscription goes out
    with it, so batches published from then on reach it."""
    from zmq.utils.monitor import recv_monitor_message

    try:
        assert monitor.poll(timeout_s * 1000), "the publisher never accepted the subscriber"
        recv_monitor_message(monitor)
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


def received_events(socket) -> list:
    """Every event of the batches published so far, in order."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events = []
    while socket.poll(3000):
        _topic, _seq, payload = socket.recv_multipart()
        events.extend(decoder.decode(payload).events)
    socket.close(linger=0)
    return events
