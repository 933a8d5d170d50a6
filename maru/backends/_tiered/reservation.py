"""Room for one object in a tier, held across a read from another tier: what a tiered
store's background fetch reads into, so that an object found below is promoted into the
first tier where it lands, with no copy."""

from __future__ import annotations

from maru.backends.base import Backend
from maru.errors import BackendError
from maru.log import get_logger

log = get_logger(__name__)


class Reservation:
    """Room for one object in a tier, ended once: committed, or aborted (its space
    freed); where the tier has none, a private buffer (`held` False)."""

    def __init__(self, tier: Backend, key: bytes, nbytes: int) -> None:
        self._context = tier.reserve(key, nbytes)
        try:
            buffer = self._context.__enter__()
        except BackendError as exc:
            log.warning("maru tier %s failed to reserve, reading privately: %s", tier.name, exc)
            buffer = None
        self.held = buffer is not None
        self.buffer = buffer if buffer is not None else memoryview(bytearray(nbytes))

    def end(self, commit: bool) -> None:
        if self.held:
            self.held = False
            if commit:
                self._context.__exit__(None, None, None)
            else:
                aborted = RuntimeError("reservation aborted")
                self._context.__exit__(RuntimeError, aborted, None)
