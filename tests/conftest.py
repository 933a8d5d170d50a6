"""Shared fixtures: every test starts with no MARU_* settings from the outside."""

from __future__ import annotations

import importlib.util
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.context import SpawnProcess

import pytest

import maru
from maru.backends.base import Backend
from maru.backends.shm import shm_path

REQUIRED = ("torch", "vllm", "redis", "fakeredis")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to run, loudly, without what the tests need (never skip them)."""
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        raise pytest.UsageError(
            f"missing Python packages {', '.join(missing)}: run `make test`, which installs "
            "them (pip install -e '.[test]')"
        )


ENGINE_MODULE = "maru.cli._engine"
"""Where the function an engine process runs lives (`maru.cli._engine.run_engine`)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A test not marked slow that starts a vLLM engine process (in the test or in one
    of its fixtures) fails, so `make check` (`-m "not slow"`) never runs an engine."""
    if item.get_closest_marker("slow"):
        return (yield)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SpawnProcess, "start", _refusing_engines(SpawnProcess.start))
        return (yield)


def _refusing_engines(start: Callable[[SpawnProcess], None]) -> Callable[[SpawnProcess], None]:
    """`start` that fails the running test instead of starting a vLLM engine process."""

    def start_unless_engine(process: SpawnProcess) -> None:
        target = getattr(process, "_target", None)
        if getattr(target, "__module__", None) == ENGINE_MODULE:
            pytest.fail(
                "this test starts a vLLM engine process: mark it @pytest.mark.slow "
                "(`make check` leaves slow tests out)",
                pytrace=False,
            )
        start(process)

    return start_unless_engine


@pytest.fixture(autouse=True)
def clean_maru_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MARU_"):
            monkeypatch.delenv(name)


@pytest.fixture
def open_stores() -> Iterator[Callable[..., Backend]]:
    """Open stores by config overrides; all are closed at teardown."""
    stores: list[Backend] = []

    def opener(**overrides: object) -> Backend:
        store = maru.open_store(maru.load_config(**overrides))
        stores.append(store)
        return store

    yield opener
    for store in stores:
        store.close()


def unique_name(prefix: str = "t") -> str:
    """A name no other test uses (pool names, mock store names)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def stall_reservations(
    monkeypatch: pytest.MonkeyPatch, store: Backend
) -> tuple[threading.Event, threading.Event]:
    """Make `store`'s writes wait: (writing, released), set once a write has started,
    and to be set by the test to let the writes go on."""
    writing, released = threading.Event(), threading.Event()
    begin = store._begin

    def stalled(key: bytes, nbytes: int) -> object:
        writing.set()
        released.wait(30)
        return begin(key, nbytes)

    monkeypatch.setattr(store, "_begin", stalled)
    return writing, released


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """A random-weight Llama small enough for vLLM's CPU backend, built locally."""
    from maru.cli._tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def harness(tiny_model):
    """Makes vLLM's real Scheduler with the maru connector (`tests.vllm_harness`), each
    over a store of its own unless `pool` names one; closed at teardown."""
    from tests.vllm_harness import SchedulerHarness

    made = []

    def make(**options):
        made.append(SchedulerHarness(tiny_model, options.pop("pool", unique_name()), **options))
        return made[-1]

    yield make
    for harness in made:
        harness.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real redis-server on a free loopback port, evicting as the README recommends."""
    from tests.redis_server import RedisServer

    server = RedisServer(
        tmp_path_factory.mktemp("redis"), "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"
    ).start()
    yield server
    server.stop()


def call_with_deadline(function, seconds: float = 20):
    """Run `function`; fail the test if it hangs (a guard, not a speed measurement)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(("ok", function()))
        except Exception as exc:
            outcome.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"{function} hung for {seconds} s"
    return outcome[0]


@pytest.fixture
def pool_config(tmp_path):
    """A config file naming a private 64 MiB shm pool, and the pool's name; the pool is
    removed at teardown."""
    name = unique_name("cli")
    path = tmp_path / "maru.yaml"
    path.write_text(f"backend: shm\ncapacity: 64MiB\nshm:\n  name: {name}\n")
    yield str(path), name
    shm_path(name).unlink(missing_ok=True)


@pytest.fixture
def pool_names():
    """Fresh pool names; their shared memory objects are removed at teardown."""
    names: list[str] = []

    def make() -> str:
        names.append(unique_name("test"))
        return names[-1]

    yield make
    for name in names:
        shm_path(name).unlink(missing_ok=True)


VLLM_FEATURES = {
    "hybrid_loads": "a vLLM that takes a failed load of one request (get_transfer_results, "
    "0.31 and later), which serving a model of several KV cache groups needs",
    "worker_channel": "a vLLM with a per-connector worker channel (KVConnectorWorkerMetadata)",
}
"""Markers of tests that need what older vLLM releases lack (`tests.vllm_harness.vllm_features`
says whether this one has it)."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked cuda fails, saying what it needs, on a machine without a GPU, and
    one marked with a VLLM_FEATURES marker on a vLLM release without the feature (the
    Makefile leaves them out there)."""
    needed = [name for name in VLLM_FEATURES if item.get_closest_marker(name) is not None]
    if needed:
        from maru.vllm.compat import vllm_version
        from tests.vllm_harness import vllm_features

        present = vllm_features()
        for name in needed:
            if not present[name]:
                pytest.fail(
                    f"needs {VLLM_FEATURES[name]}; this is vLLM {vllm_version()}: run it "
                    f"on .venv's vLLM (`make check`), or leave it out with -m 'not {name}' as "
                    "`make test` does on the older releases"
                )
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.fail(
                "needs an NVIDIA GPU with CUDA, and this machine has none: run it on "
                "one (`.venv/bin/python -m pytest -m cuda`), or leave it out with "
                "-m 'not cuda' as `make check` and `make test` do here"
            )


@pytest.fixture
def tiered(open_stores, redis_server):
    """Open shm-over-redis stores with private pool and key names."""
    pools: list[str] = []

    def make(capacity: int = 8 << 20, url: str | None = None, **shm) -> maru.Backend:
        pools.append(unique_name("tier"))
        return open_stores(
            backend="tiered",
            capacity=capacity,
            namespace=unique_name(),
            tiered={"tiers": ["shm", "redis"]},
            shm={"name": pools[-1], **shm},
            redis={"url": url or redis_server.url},
        )

    yield make
    for pool in pools:
        shm_path(pool).unlink(missing_ok=True)


@pytest.fixture
def shm_disk(open_stores, tmp_path):
    """Open shm-over-disk stores (`tiers` to add more): a small shm pool, a disk store
    `disk_capacity` large, under `tmp_path`."""
    pools: list[str] = []

    def make(
        capacity: int = 4 << 20,
        disk_capacity: str = "64MiB",
        tiers: tuple[str, ...] = ("shm", "disk"),
        pool: str | None = None,
        redis: str | None = None,
        **tiered,
    ) -> maru.Backend:
        pools.append(pool or unique_name("tier"))
        return open_stores(
            backend="tiered",
            capacity=capacity,
            namespace="tiers",
            tiered={"tiers": list(tiers), **tiered},
            shm={"name": pools[-1]},
            disk={"path": str(tmp_path / "disk"), "capacity": disk_capacity},
            **({"redis": {"url": redis}} if redis else {}),
        )

    yield make
    for pool in pools:
        shm_path(pool).unlink(missing_ok=True)


def failing(message: str):
    def fail(*args, **kwargs):
        raise maru.BackendError(message)

    return fail
