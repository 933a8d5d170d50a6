"""A hit on a slow tier loads only where its load is expected to end before its prefill
would: both rates are learned as the engine runs (`maru.vllm.loadpolicy`)."""

from __future__ import annotations

import threading
import time

import pytest

import maru
from maru.backends.mock import MockBackend
from maru.vllm.loadpolicy import (
    LOAD_MARGIN,
    PROBE_EVERY_S,
    PROBES_TRUSTED,
    LoadPolicy,
    Verdict,
)
from tests.test_async_loads import tokens

CHUNK = 64
GUARD_S = 30
"""How long a test waits for a probe that must end (never a speed requirement)."""


class Clock:
    """The policy's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


MADE: list[LoadPolicy] = []


@pytest.fixture(autouse=True)
def closed_after():
    """Every policy a test makes (`new_policy`) is closed after it: its probe thread
    joined."""
    yield
    while MADE:
        MADE.pop().close()


def new_policy(**settings) -> LoadPolicy:
    MADE.append(LoadPolicy(chunk_tokens=CHUNK, **settings))
    return MADE[-1]


def policy_with_rates(prefill: float, load: float | None = None) -> tuple[LoadPolicy, Clock]:
    """A policy that has seen one busy prefill step at `prefill` tokens per second (and
    one background load at `load`)."""
    clock = Clock()
    policy = new_policy(always=False, clock=clock)
    policy.stepped(1000, {"a"}, live={"a"})
    clock.advance(1000 / prefill)
    policy.stepped(1, {"a"}, live={"a"})
    if load is not None:
        policy.load_planned("b", 1000, groups=1)
        clock.advance(1000 / load)
        policy.load_ended("b", loaded=True)
    return policy, clock


def never_read() -> bytes:
    raise AssertionError("no probe expected")


def settled(policy: LoadPolicy, tokens: int, probe) -> Verdict:
    """The verdict once a probe started by asking has ended (a guard against a hang)."""
    until = time.monotonic() + GUARD_S
    while (verdict := policy.verdict(tokens, 1, probe)) is Verdict.WAIT:
        assert time.monotonic() < until, "the probe never ended"
        time.sleep(0.01)
    return verdict


def test_the_prefill_rate_is_learned_from_busy_steps_of_at_least_a_chunk() -> None:
    clock = Clock()
    policy = new_policy(always=False, clock=clock)
    policy.stepped(500, {"a"}, live={"a"})
    clock.advance(0.5)
    policy.stepped(10, {"a"}, live={"a"})
    assert policy.prefill.value == pytest.approx(1000)
    clock.advance(5)  # a decode step (10 tokens): not a prefill
    policy.stepped(600, {"b"}, live={"a", "b"})
    assert policy.prefill.value == pytest.approx(1000)
    clock.advance(60)  # every request of the step finished: the engine may have idled
    policy.stepped(600, {"c"}, live={"c"})
    assert policy.prefill.value == pytest.approx(1000)
    clock.advance(0.3)  # a request of one step (max_tokens 1): its finish ends the step
    policy.finished("c")
    policy.finished("c")
    clock.advance(60)
    policy.stepped(600, {"d"}, live={"d"})
    assert policy.prefill.value == pytest.approx(0.7 * 1000 + 0.3 * 2000), "counted once"


@pytest.mark.parametrize(
    ("load_rate", "verdict"),
    [
        (10_000, Verdict.LOAD),
        (LOAD_MARGIN * 1000 * 1.01, Verdict.RECOMPUTE),
        (100, Verdict.RECOMPUTE),
    ],
)
def test_a_slow_hit_loads_only_where_it_is_expected_to_beat_its_prefill(load_rate, verdict) -> None:
    policy, _ = policy_with_rates(prefill=1000, load=load_rate)
    assert policy.verdict(2000, 1, never_read) is verdict


def test_every_kv_cache_group_is_read() -> None:
    policy, _ = policy_with_rates(prefill=1000, load=2000)
    assert policy.verdict(2000, 1, never_read) is Verdict.LOAD
    assert policy.verdict(2000, 3, never_read) is Verdict.RECOMPUTE, "3 objects per chunk"


def test_the_first_slow_hit_waits_for_a_probe_while_the_prefill_rate_is_unknown() -> None:
    policy = new_policy(always=False, clock=Clock())
    released, calls = threading.Event(), []

    def probe() -> bytes:
        calls.append(1)
        released.wait(GUARD_S)
        return b"x"

    assert policy.verdict(2000, 1, probe) is Verdict.WAIT
    assert policy.verdict(2000, 1, probe) is Verdict.WAIT, "one probe at a time"
    released.set()
    assert settled(policy, 2000, probe) is Verdict.LOAD, "nothing to compare with: load"
    assert calls == [1] and policy.load.value is not None


def test_the_first_slow_hit_is_judged_by_a_probe_it_waits_for() -> None:
    policy, _ = policy_with_rates(prefill=CHUNK / 5.0)  # a chunk computes in 5 s

    def probe() -> bytes:
        time.sleep(0.01)
        return b"x"

    assert policy.verdict(2000, 1, probe) is Verdict.LOAD, "waited for, then faster"


def test_a_probe_past_one_chunks_prefill_means_recompute_and_its_time_is_learnt_later() -> None:
    policy, _ = policy_with_rates(prefill=CHUNK / 0.05)  # a chunk computes in 50 ms
    released = threading.Event()
    probe = lambda: released.wait(GUARD_S) and b"x"  # noqa: E731
    assert settled(policy, 2000, probe) is Verdict.RECOMPUTE
    assert policy.load.value is None, "nothing measured yet"
    released.set()
    until = time.monotonic() + GUARD_S
    while policy.load.value is None:  # what it measured, once it ended
        assert time.monotonic() < until, "the probe's time was never learnt"
        assert policy.verdict(2000, 1, never_read) is Verdict.RECOMPUTE
        time.sleep(0.01)
    assert policy.load.value <= CHUNK / 0.05, "slower than computing the chunk"


def test_a_probe_that_finds_nothing_lets_the_hit_load() -> None:
    policy, _ = policy_with_rates(prefill=1000)
    assert settled(policy, 2000, lambda: None) is Verdict.LOAD


def test_one_slow_probe_is_checked_again_at_the_next_slow_hits() -> None:
    policy, _ = policy_with_rates(prefill=1000, load=100)  # one observation: maybe a hiccup
    fast = lambda: b"x"  # noqa: E731
    until = time.monotonic() + GUARD_S
    while settled(policy, 2000, fast) is not Verdict.LOAD:
        assert time.monotonic() < until, "one slow read was taken for a slow tier"
        time.sleep(0.01)


def test_a_tier_found_slow_is_probed_again_once_its_rate_is_old() -> None:
    policy, clock = policy_with_rates(prefill=1000, load=100)
    for _ in range(PROBES_TRUSTED - 1):  # slow every time: trusted
        policy.load.observe(100, 1.0, clock())
    probed = threading.Event()

    def probe() -> bytes:
        probed.set()
        return b"x"

    assert policy.verdict(2000, 1, probe) is Verdict.RECOMPUTE
    assert not probed.wait(0.2), "a trusted rate is not probed again before it is old"
    clock.advance(PROBE_EVERY_S)
    assert policy.verdict(2000, 1, probe) is Verdict.RECOMPUTE, "not waited for"
    assert probed.wait(GUARD_S)
    for _ in range(20):  # the fast probes pull the average up
        clock.advance(PROBE_EVERY_S)
        if settled(policy, 2000, probe) is Verdict.LOAD:
            return
    raise AssertionError("a tier that became fast was never loaded from again")


def test_always_loads_without_a_probe() -> None:
    policy = new_policy(always=True)
    assert policy.verdict(2000, 1, never_read) is Verdict.LOAD


# --- inside vLLM's scheduler ---


@pytest.fixture
def remote(monkeypatch):
    monkeypatch.setattr(MockBackend, "medium", "remote")


def clocked(h) -> Clock:
    """Give the scheduler half's policy a clock the test moves (steps take no time)."""
    clock = Clock()
    h.connector.scheduler.policy.clock = clock
    return clock


def learned(h, prefill: float) -> None:
    """Make the scheduler half's policy learn a prefill rate from a real cold prefill."""
    clock = h.connector.scheduler.policy.clock
    h.add("cold", tokens(300, start=20000), max_tokens=2)  # live at the next step
    h.step()
    clock.advance(300 / prefill)
    h.step()


def hit_tokens(h, req_id: str, prompt: list[int]) -> int | None:
    return h.connector.get_num_new_matched_tokens(h.add(req_id, prompt), 0)[0]


def settled_hit(h, req_id: str, prompt: list[int]) -> int:
    """The tokens the connector offers once its probe has ended."""
    request, until = h.add(req_id, prompt), time.monotonic() + GUARD_S
    while (offered := h.connector.get_num_new_matched_tokens(request, 0)[0]) is None:
        assert time.monotonic() < until, "the probe never ended"
        time.sleep(0.01)
    return offered


@pytest.mark.parametrize(
    ("prefill", "offered", "recomputed"),
    [(1.0, 288, 0), (1e12, 0, 288)],
    ids=["prefill slower than the tier", "prefill faster than the tier"],
)
def test_a_remote_hit_is_offered_only_where_loading_beats_computing(
    harness, remote, prefill, offered, recomputed
) -> None:
    h = harness()
    clocked(h)
    h.add("first", tokens(300))
    h.step()
    learned(h, prefill)
    assert settled_hit(h, "second", tokens(300)) == offered
    policy, until = h.connector.scheduler.policy, time.monotonic() + GUARD_S
    while policy.gauges()[1] is None:  # the probe, where it was not waited for, ends
        assert time.monotonic() < until, "the probe never ended"
        time.sleep(0.01)
    report = h.connector.scheduler.report().data  # what vLLM logs and hands to Prometheus
    assert report["slow_hits_recomputed"] == recomputed
    assert report["prefill_tokens_per_s"] == pytest.approx(prefill, rel=1e-3)
    assert report["slow_load_tokens_per_s"] > 0, "the probe's"


def test_a_consumer_loads_every_remote_hit(harness, remote) -> None:
    h = harness(kv_role="kv_consumer")
    clocked(h)
    learned(h, prefill=1e12)
    second = h.add("second", tokens(300))
    for chunk_key in h.chunk_keys(second):  # what its producer saved
        assert h.store.put(h.connector.scheduler.shares(chunk_key)[0], b"x" * 64)
    offered, background = h.connector.get_num_new_matched_tokens(second, 0)
    assert (offered, background) == (256, True), "no probe, no verdict: loaded"


def test_a_probe_that_fails_only_after_its_wait_teaches_that_the_tier_is_slow() -> None:
    policy, _ = policy_with_rates(prefill=CHUNK / 0.01)  # a chunk computes in 10 ms

    def timing_out() -> bytes:
        time.sleep(0.05)
        raise maru.BackendError("get on redis://...: TimeoutError")

    assert settled(policy, 2000, timing_out) is Verdict.RECOMPUTE
    until = time.monotonic() + GUARD_S
    while policy.load.value is None:
        assert time.monotonic() < until, "the failed probe taught nothing"
        assert policy.verdict(2000, 1, never_read) is Verdict.RECOMPUTE
        time.sleep(0.01)
    assert policy.verdict(2000, 1, never_read) is Verdict.RECOMPUTE, "not 'inconclusive'"
