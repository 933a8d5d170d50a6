"""Whether a hit on a slow tier is worth loading: a load never costs more than recomputing.

A hit in memory (shm, cxl, a tiered store's first tier) always loads: a memory copy is
far cheaper than a prefill. A hit on a slow tier (disk, remote) loads only where reading
it is expected to end before vLLM would have computed the same tokens:

    expected load    = hit tokens x KV cache groups / load rate
    expected prefill = hit tokens / prefill rate
    load where expected load <= LOAD_MARGIN x expected prefill

Both rates (tokens per second) are learned as the engine runs, as moving averages: the
prefill rate from the engine's steps (tokens scheduled, over the time to the next step,
for steps of at least a chunk while the engine stays busy), the load rate from finished
background loads (from the step that planned them to the step that reports them) and
from probes. The first slow hit the connector sees waits (vLLM asks again next step)
while one of its objects is read off the engine's thread, for at most one chunk's
prefill; where the verdict is to recompute, a probe runs again, beside the engine, while
the rate rests on fewer than PROBES_TRUSTED observations or is PROBE_EVERY_S old, so a
hiccup is not taken for a slow tier and a tier that became fast is found.

`slow_hits` in maru's config: "when_faster" (the above), "always" (every hit loads: a
P/D consumer must, its producer computed the prompt for it), or "auto" (always for
vLLM's kv_consumer role, else when_faster).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from maru.log import get_logger
from maru.vllm.roles import Role

LOAD_MARGIN = 0.8
"""A slow hit loads only if its load is expected to take at most this share of the
prefill it saves (what the estimates miss stays on the side of recomputing)."""
WEIGHT = 0.3
"""Weight of the newest observation in a moving average."""
PROBE_EVERY_S = 60.0
"""Age of a load rate after which a verdict to recompute reads one object again."""
PROBES_TRUSTED = 3
"""Observations of a load rate before a verdict to recompute stops reading one object
again (beside the engine) at each slow hit: one slow read may be a hiccup."""
PROBE_WAIT_S = 1.0
"""How long a request waits for a probe where the prefill rate is not known yet."""
PROBE_YIELD_S = 0.001
"""How long asking for a verdict waits for a running probe, each step, while the prefill
rate is unknown."""
PROBE_CLOSE_WAIT_S = 1.0
"""How long closing waits for a probe still reading (its read has its own deadline)."""

log = get_logger(__name__)


def loads_always(setting: str, role: Role) -> bool:
    """Does every slow hit load (`slow_hits`: always, or auto for a P/D consumer)?"""
    return setting == "always" or (setting == "auto" and role.waits)


class Verdict(enum.Enum):
    LOAD = "load"
    RECOMPUTE = "recompute"
    WAIT = "wait"
    """A probe is reading: ask again next step."""


@dataclass
class Rate:
    """Tokens per second, a moving average (None until observed)."""

    value: float | None = None
    count: int = 0
    """Observations so far."""
    at: float = float("-inf")
    """When it was last observed (the policy's clock)."""

    def observe(self, tokens: float, seconds: float, now: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.value = rate if self.value is None else (1 - WEIGHT) * self.value + WEIGHT * rate
        self.count += 1
        self.at = now


@dataclass
class Step:
    """A step the scheduler planned: when, and what it scheduled."""

    at: float
    tokens: int
    req_ids: frozenset[str]
    counted: bool = False
    """Its time was learnt from."""


@dataclass
class LoadPolicy:
    """Learns the rates and gives each slow hit its verdict; see the module docstring."""

    always: bool
    chunk_tokens: int
    clock: Callable[[], float] = time.monotonic
    prefill: Rate = field(default_factory=Rate)
    load: Rate = field(default_factory=Rate)
    _step: Step | None = None
    _loads: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Background loads in flight: when planned, and tokens x groups."""
    _probe: Probe | None = None
    _inconclusive: bool = False
    """A probe ended without a rate (the object was gone, the store failed): slow hits
    load, and their loads teach the rate."""
    _said: Verdict | None = None
    """The last verdict logged (each change is)."""

    # learning

    def stepped(self, tokens: int, req_ids: Collection[str], live: Collection[str]) -> None:
        """A step was planned with `tokens` scheduled for `req_ids`; `live` are the
        requests not finished. The previous step's time counts where one of its requests
        is still live (the engine went on at once, it did not idle)."""
        last = self._step
        if last is not None and not last.req_ids.isdisjoint(live):
            self._step_took(last)
        self._step = Step(self.clock(), tokens, frozenset(req_ids))

    def finished(self, req_id: str) -> None:
        """A request finished: the output of the step that scheduled it is in, so that
        step's time counts (a request of one step, e.g. max_tokens 1, has no next)."""
        last = self._step
        if last is not None and req_id in last.req_ids:
            self._step_took(last)

    def _step_took(self, step: Step) -> None:
        """Learn from a step that ended now, once, where it was a prefill of a chunk or
        more."""
        if not step.counted and step.tokens >= self.chunk_tokens:
            now = self.clock()
            self.prefill.observe(step.tokens, now - step.at, now)
        step.counted = True

    def load_planned(self, req_id: str, tokens: int, groups: int) -> None:
        self._loads[req_id] = (self.clock(), tokens * groups)

    def load_ended(self, req_id: str, loaded: bool) -> None:
        """A background load was reported; a loaded one teaches the load rate (a failed
        one may have ended early, for a reason that says nothing of the rate)."""
        planned = self._loads.pop(req_id, None)
        if planned is not None and loaded:
            now = self.clock()
            self.load.observe(planned[1], now - planned[0], now)

    # deciding

    def verdict(self, tokens: int, groups: int, probe: Callable[[], bytes | None]) -> Verdict:
        """Load a slow hit of `tokens` tokens, recompute them, or wait for a probe (a
        read of one of its objects, `probe`)?"""
        if self.always:
            return Verdict.LOAD
        self._take_probe()
        if self.load.value is None and (waiting := self._while_unknown(probe)) is not None:
            return waiting
        if self.prefill.value is None:
            return Verdict.LOAD  # nothing to compare with: the engine's first requests
        load_s, prefill_s = tokens * groups / self.load.value, tokens / self.prefill.value
        verdict = Verdict.LOAD if load_s <= LOAD_MARGIN * prefill_s else Verdict.RECOMPUTE
        if verdict is Verdict.RECOMPUTE and (
            self.load.count < PROBES_TRUSTED or self.clock() - self.load.at >= PROBE_EVERY_S
        ):
            self._start_probe(probe)
        return self._say(
            verdict,
            "maru: hits on a slow tier now %s: %d tokens would load in %.1f ms "
            "(%.0f tokens/s) and compute in %.1f ms (%.0f tokens/s)",
            "load" if verdict is Verdict.LOAD else "are recomputed",
            tokens,
            load_s * 1e3,
            self.load.value,
            prefill_s * 1e3,
            self.prefill.value,
        )

    def _say(self, verdict: Verdict, message: str, *args: object) -> Verdict:
        """`verdict`, logged with `message` where it differs from the last one logged."""
        if verdict is not self._said:
            self._said = verdict
            log.info(message, *args)
        return verdict

    def _while_unknown(self, probe: Callable[[], bytes | None]) -> Verdict | None:
        """The verdict while no load rate is known: wait for a probe, recompute once it
        has taken longer than a chunk's prefill, load where a probe found nothing; None
        where the probe has just taught the rate."""
        if self._inconclusive:
            return Verdict.LOAD
        if self._probe is None:
            self._start_probe(probe)
        # Wait here, where the probe's thread gets the interpreter (the engine's loop
        # would hold it but every switch interval, 5 ms, and a read of a few MiB takes
        # many turns): at most one chunk's prefill, once; while the prefill rate is
        # unknown (a second's wait), a moment each step.
        wait = PROBE_YIELD_S if self.prefill.value is None else self._probe.left()
        if self._probe.done.wait(wait):
            self._take_probe()
            return None if self.load.value is not None else Verdict.LOAD
        if not self._probe.overdue:
            return Verdict.WAIT
        return self._say(
            Verdict.RECOMPUTE,
            "maru: hits on a slow tier are recomputed: reading one of its objects took "
            "longer than computing a chunk (%.1f ms)",
            self._probe.wait_s * 1e3,
        )

    def _start_probe(self, probe: Callable[[], bytes | None]) -> None:
        """Read one object (a chunk's tokens of one group) on a thread of its own; a
        request waits for it at most one chunk's prefill (PROBE_WAIT_S while the prefill
        rate is unknown), and what it measures is learnt whenever it ends."""
        if self._probe is None:
            wait = (
                PROBE_WAIT_S
                if self.prefill.value is None
                else self.chunk_tokens / self.prefill.value
            )
            self._probe = Probe(probe, wait)

    def _take_probe(self) -> None:
        """Learn from a probe that ended."""
        probe = self._probe
        if probe is None or not probe.done.is_set():
            return
        self._probe = None
        if probe.found or probe.seconds >= probe.wait_s:  # a failure that slow says enough
            self.load.observe(self.chunk_tokens, probe.seconds, self.clock())
        else:
            self._inconclusive = self.load.value is None

    def gauges(self) -> tuple[float | None, float | None]:
        """The learned rates, tokens per second: prefill, and loads from slow tiers."""
        self._take_probe()
        return self.prefill.value, self.load.value

    def close(self) -> None:
        if self._probe is not None:
            self._probe.join(PROBE_CLOSE_WAIT_S)


class Probe:
    """One read of one object on a thread of its own (`maru-probe`), timed."""

    def __init__(self, read: Callable[[], bytes | None], wait_s: float) -> None:
        self.wait_s = wait_s
        self.deadline = time.monotonic() + wait_s
        """Until when a request waits for it."""
        self.seconds = 0.0
        """How long the read took."""
        self.found = False
        """Whether it read the object (not a miss, not a failure)."""
        self.done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(read,), name="maru-probe", daemon=True
        )
        self._thread.start()

    @property
    def overdue(self) -> bool:
        return not self.done.is_set() and time.monotonic() >= self.deadline

    def left(self) -> float:
        """Seconds until the deadline."""
        return max(0.0, self.deadline - time.monotonic())

    def _run(self, read: Callable[[], bytes | None]) -> None:
        started = time.perf_counter()
        try:
            self.found = read() is not None
        except Exception as exc:  # the load itself will fail and say why
            log.debug("maru: a probe of a slow tier failed: %s", exc)
        finally:
            self.seconds = time.perf_counter() - started
            self.done.set()

    def join(self, seconds: float) -> None:
        self._thread.join(seconds)
