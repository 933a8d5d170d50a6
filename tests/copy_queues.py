"""A copy queue whose copies run only when the test lets them: a stream, slowed down.

It keeps the contract of `maru.transfer.CopyQueue` (copies run in order; a marker
is done once everything queued before it ran; waiting on a marker, or making the
compute wait for it, lets the copies up to it run), so on the CPU the tests see
what a CUDA stream would allow: work that is queued but not yet done.
"""

from __future__ import annotations

from collections.abc import Callable

from maru.transfer import CopyQueue, Marker


class DeferredQueue(CopyQueue):
    synchronous = False

    def __init__(self, meanwhile: Callable[[], None] | None = None) -> None:
        self.queued: list[Callable[[], None]] = []
        self.ran = 0
        self.meanwhile = meanwhile
        """Called once, just before the first copy runs (what happens while copies run)."""

    def run(self, copy: Callable[[], None]) -> None:
        self.queued.append(copy)

    def mark(self) -> Marker:
        return DeferredMarker(self, len(self.queued))

    def run_until(self, position: int) -> None:
        """Run the queued copies up to `position` (all of them by default)."""
        if self.meanwhile is not None and self.ran < position:
            self.meanwhile, meanwhile = None, self.meanwhile
            meanwhile()
        while self.ran < position:
            self.queued[self.ran]()
            self.ran += 1

    def drain(self) -> None:
        self.run_until(len(self.queued))


class DeferredMarker(Marker):
    def __init__(self, queue: DeferredQueue, position: int) -> None:
        self.queue, self.position = queue, position

    def done(self) -> bool:
        return self.queue.ran >= self.position

    def wait(self) -> None:
        self.queue.run_until(self.position)

    hold_compute = wait


class FailingQueue(CopyQueue):
    """Runs the first `after` copies at once, as the CPU does; every later one fails as a
    broken device copy would."""

    def __init__(self, after: int) -> None:
        self.left = after

    def run(self, copy: Callable[[], None]) -> None:
        if self.left <= 0:
            raise RuntimeError("copy failed")
        self.left -= 1
        copy()
