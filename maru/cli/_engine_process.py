"""The parent's side of an engine process: what it produced, its turns, its end.

`maru.cli._engine` starts the process; this module waits on it, lets it take turns,
and turns a child that raised, hung or died into an `EngineRunError` that says why.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any


class EngineRunError(RuntimeError):
    """The engine process raised or died; the message carries the child's traceback."""


@dataclass
class EngineRun:
    """What one engine process produced. Lists are in prompt order."""

    token_ids: list[list[int]]
    """Generated token ids per prompt (greedy)."""
    ttft_s: list[float | None]
    """Time to first token per prompt, from `RequestOutput.metrics.first_token_latency`
    (arrival to first token, wall clock). With `sequential=True` each prompt runs alone,
    so this is its own prefill (+ any KV load) time."""
    num_cached_tokens: list[int | None]
    """`RequestOutput.num_cached_tokens`: prompt tokens not computed, i.e. local prefix
    cache hits plus KV-connector (external) hits."""
    external_cached_tokens: list[int | None]
    """Per prompt, tokens the KV connector supplied (growth of the
    `vllm:external_prefix_cache_hits` counter over that prompt); None unless
    `sequential=True` and a connector is configured."""
    kv_transfer_params: list[dict[str, Any] | None]
    """`RequestOutput.kv_transfer_params` per prompt (whatever the connector's
    `request_finished` returned; None for most connectors)."""
    metrics: dict[str, float]
    """Prefix-cache counters at the end of the run (`_engine_inspect.PREFIX_CACHE_METRICS`)."""
    startup_s: float
    """Seconds to import vLLM and construct the `LLM` (model load, KV cache allocation)."""
    generate_s: float
    """Seconds spent in `LLM.generate` over all prompts (waits between turns left out)."""
    wall_s: float = 0.0
    """Seconds from starting the child process to receiving its result (set by parent)."""
    exit_s: float = 0.0
    """Seconds the child then took to shut down and exit (set by parent)."""
    kv_connector: str | None = None
    """The `kv_connector` named in `kv_transfer_config`, if any."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form facts from the child (vLLM version, block size, number of KV blocks)."""


@dataclass
class Turn:
    """The handshake of an engine started with `turns`: the parent releases `begin` for
    each group of prompts, the child releases `ended` once it has run it; after the
    last, `begin` once more lets the child finish (`EngineProcess.result`)."""

    begin: Any
    ended: Any


@dataclass
class EngineProcess:
    """An engine started by `start_engine`."""

    proc: Any
    recv: Any
    built: Any
    """Set by the child once its LLM is built."""
    go: Any
    """Set to let the child generate."""
    turn: Turn
    started: float
    timeout_s: float

    def wait_built(self) -> None:
        """Wait until the engine is built, or has failed (`result()` then says why)."""
        while not self.built.wait(0.5):
            if not self.proc.is_alive() or self.recv.poll(0):
                return

    def release(self) -> None:
        """Let a held engine generate."""
        self.go.set()

    def take_turn(self) -> None:
        """Let an engine started with `turns` run its next group of prompts; return once
        it has (raises `EngineRunError` if the engine failed or ended instead)."""
        self.release()
        self.turn.begin.release()
        deadline = time.monotonic() + self.timeout_s
        while not self.turn.ended.acquire(timeout=0.5):
            over = time.monotonic() > deadline
            if self.proc.is_alive() and not self.recv.poll(0) and not over:
                continue
            if self.turn.ended.acquire(timeout=0):  # it ended its turn, then the run
                return
            if over:
                self.stop()
                raise EngineRunError(f"the engine's turn took over {self.timeout_s:.0f} s")
            self.result()  # raises with the child's traceback if it failed
            raise EngineRunError("the engine ended without running this turn (none was left)")

    def stop(self) -> None:
        """End the process if it still runs (e.g. a held engine that is not needed)."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def result(self) -> EngineRun:
        """Release the engine and wait for what it produced."""
        self.release()
        self.turn.begin.release()  # an engine with turns waits for it once they are done
        try:
            result = _receive(self.recv, self.proc, self.timeout_s)
            received = time.perf_counter()
        finally:
            self.recv.close()
            self.proc.join(timeout=30)
            self.stop()
        status, payload = result
        if status != "ok":
            raise EngineRunError(f"vLLM engine process failed:\n{payload}")
        run = EngineRun(**payload)
        run.wall_s = received - self.started
        run.exit_s = time.perf_counter() - received
        return run


def _receive(recv: Any, proc: Any, timeout_s: float) -> tuple[str, Any]:
    """Wait for the child's one message; turn a hang or a silent death into an error."""
    deadline = time.monotonic() + timeout_s
    while True:
        if recv.poll(1.0):
            try:
                return recv.recv()
            except EOFError:
                pass  # child closed the pipe without sending: report its exit below
            proc.join(timeout=10)
            return "error", _no_result(proc.exitcode)
        if not proc.is_alive():
            if recv.poll(0):
                continue
            return "error", _no_result(proc.exitcode)
        if time.monotonic() > deadline:
            proc.kill()
            return "error", f"engine process timed out after {timeout_s:.0f} s"


def _no_result(exitcode: int | None) -> str:
    """Explain a child that ended without sending a result.

    The child reports every error of its job, so one that sent nothing was killed by a
    signal (a crash in native code, or from outside) or exited before the job started
    (e.g. while re-importing the caller's main module)."""
    if exitcode is not None and exitcode < 0:
        return (
            f"engine process killed by {signal_name(-exitcode)} before it sent a result "
            "(its stderr says where)"
        )
    text = (
        f"engine process exited with code {exitcode} before running its job (its stderr says why)"
    )
    if exitcode == 1:
        text += "; a script that calls run_engine needs an `if __name__ == '__main__':` guard"
    return text


def signal_name(number: int) -> str:
    """SIGILL for 4; the number where Python knows no such signal."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
