"""`maru pool list|gc`: every maru store on the node, who holds it, and the removal of
leaked ones (a creator killed by a signal), never one a live process holds."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import maru
import maru.backends.holders
from maru.backends.shm import shm_path
from maru.cli import main

NOBODY = "nobody"
HOLD = """
import sys, time, maru
store = maru.open_store(maru.MaruConfig(backend="shm", capacity="64MiB", shm={{"name": "{name}"}}))
store.put(b"k", b"x" * 100_000)
print("ready", flush=True)
time.sleep(600)
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def holding(name: str) -> subprocess.Popen:
    """A process that creates pool `name`, writes to it and holds it."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(name=name)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "ready"
    return process


def as_user(user: str, work: Callable[[], str], *, stay: bool = False) -> tuple[int, str]:
    """Fork a child that becomes `user` and runs `work`: its pid and what `work` returned.
    Forked, not a new interpreter: this one's files may be out of that user's reach.
    With `stay`, the child lives on until it is killed."""
    entry = pwd.getpwnam(user)
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            try:
                said = work()
            except BaseException as exc:
                said = f"failed: {exc!r}"
            os.write(writable, said.encode())
            os.close(writable)
            while stay:
                time.sleep(1)
        finally:
            os._exit(0)
    os.close(writable)
    with os.fdopen(readable, "rb") as answer:
        said = answer.read().decode()
    return pid, said


def listed(capsys, name: str) -> dict:
    code, out, _ = run(capsys, "pool", "list", "--name", name, "--json")
    assert code == 0
    (store,) = json.loads(out)
    return store


def gc(capsys, name: str, *options: str) -> dict:
    code, out, _ = run(capsys, "pool", "gc", "--name", name, "--json", *options)
    assert code == 0
    return json.loads(out)


def kept_though_unseen(capsys, monkeypatch, proc: Path, name: str) -> None:
    """With its holders out of sight in /proc (`proc`: an empty directory), gc still
    keeps pool `name`, by the pool's own holder record."""
    monkeypatch.setattr(maru.backends.holders, "PROC", proc)
    result = gc(capsys, name, "--older-than", "0")
    assert result["removed"] == []
    assert "held by a process of another user" in result["kept"][0]["why"]


@pytest.fixture
def root_only() -> None:
    if os.geteuid() != 0:
        pytest.fail("this test starts a process of another user: run it as root")


def test_a_pool_whose_creator_was_killed_is_listed_as_leaked_and_removed(
    capsys, pool_names
) -> None:
    name = pool_names()
    creator = holding(name)
    assert listed(capsys, name)["holders"][0]["pid"] == creator.pid
    creator.send_signal(signal.SIGKILL)
    creator.wait(timeout=30)
    store = listed(capsys, name)
    assert (store["leaked"], store["held"], store["holders"]) == (True, False, [])
    assert (store["capacity"], store["objects"], store["owner"]) == (64 * 2**20, 1, "root")
    young = gc(capsys, name)
    assert young["removed"] == [] and "younger than 600 s" in young["kept"][0]["why"]
    dry = gc(capsys, name, "--dry-run", "--older-than", "0")
    assert [s["path"] for s in dry["removed"]] == [str(shm_path(name))]
    assert shm_path(name).exists()
    assert [s["path"] for s in gc(capsys, name, "--older-than", "0")["removed"]] == [
        str(shm_path(name))
    ]
    assert not shm_path(name).exists()


def test_a_pool_a_live_process_holds_is_kept_and_names_it(capsys, pool_names) -> None:
    name = pool_names()
    holder = holding(name)
    try:
        result = gc(capsys, name, "--older-than", "0")
        assert result["removed"] == []
        assert f"held by pid {holder.pid} (root: " in result["kept"][0]["why"]
        assert shm_path(name).exists()
        code, out, _ = run(capsys, "pool", "list", "--name", name)
        assert code == 0 and f"held by pid {holder.pid}" in out and "LEAKED" not in out
    finally:
        holder.kill()
        holder.wait()


def test_the_pools_own_holder_record_keeps_it_where_its_holders_cannot_be_seen(
    capsys, monkeypatch, pool_names, tmp_path
) -> None:
    """Another user's processes are invisible in /proc to a user: the holder lock in
    the pool still tells that one holds it."""
    name = pool_names()
    holder = holding(name)
    try:
        kept_though_unseen(capsys, monkeypatch, tmp_path, name)
    finally:
        holder.kill()
        holder.wait()
    assert gc(capsys, name, "--older-than", "0")["removed"]


def test_a_pool_another_users_process_holds_is_kept_and_says_whose(
    capsys, pool_names, root_only
) -> None:
    name = pool_names()
    config = maru.MaruConfig(backend="shm", capacity="64MiB", shm={"name": name})
    pid, _ = as_user(NOBODY, lambda: str(maru.open_store(config).put(b"k", b"x")), stay=True)
    try:
        assert listed(capsys, name)["owner"] == NOBODY
        result = gc(capsys, name, "--older-than", "0")
        assert result["removed"] == []
        assert f"held by pid {pid} ({NOBODY}: " in result["kept"][0]["why"]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_user_who_cannot_open_a_pool_keeps_it_and_says_why(pool_names, root_only) -> None:
    """Run as another user, gc can neither prove a root pool unheld nor remove it."""
    name = pool_names()
    with maru.open_store(maru.MaruConfig(backend="shm", capacity="64MiB", shm={"name": name})):
        pass

    def gc_as_nobody() -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["pool", "gc", "--name", name, "--older-than", "0"])
        return f"exit {code}: {out.getvalue()}"

    pid, said = as_user(NOBODY, gc_as_nobody)
    os.waitpid(pid, 0)
    assert said.startswith("exit 0: "), said
    assert "cannot tell whether it is held: this user cannot open it" in said
    assert shm_path(name).exists()


def test_a_disk_store_is_listed_and_never_collected(capsys, monkeypatch, tmp_path) -> None:
    root = tmp_path / "disk"
    config = maru.MaruConfig(backend="disk", capacity="64MiB", disk={"path": str(root)})
    with maru.open_store(config) as store:
        store.put(b"k", b"x" * 1000)
    monkeypatch.setenv("MARU_DISK__PATH", str(root))
    store = listed(capsys, str(root))
    assert (store["backend"], store["objects"], store["leaked"]) == ("disk", 1, False)
    result = gc(capsys, str(root), "--older-than", "0")
    assert result["removed"] == [] and "kept across restarts" in result["kept"][0]["why"]
    assert Path(store["path"]).is_dir()


def test_an_unreadable_duration_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["pool", "gc", "--older-than", "ten minutes"])
    assert exit_.value.code == 2
    assert "'ten minutes' is not a duration; allowed:" in capsys.readouterr().err


def test_a_forked_child_holds_the_pool_it_inherited(
    capsys, monkeypatch, pool_names, tmp_path
) -> None:
    """A child forked with the pool open holds it (its own holder record) after the
    parent has closed it."""
    name = pool_names()
    store = maru.open_store(maru.MaruConfig(backend="shm", capacity="64MiB", shm={"name": name}))
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    store.close()
    try:
        kept_though_unseen(capsys, monkeypatch, tmp_path, name)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert gc(capsys, name, "--older-than", "0")["removed"]


def test_a_benchmark_stopped_with_sigterm_leaves_no_pool_behind() -> None:
    """`maru bench` makes a private pool; SIGTERM (a benchmark stopped by hand or by a
    job runner) destroys it on the way out instead of leaking it in /dev/shm."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "maru", "bench", "--backend", "shm", "--capacity", "256MiB"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    pool = shm_path(f"bench-{bench.pid}")
    deadline = time.monotonic() + 120
    while not pool.exists() and bench.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.exists(), "the benchmark made no pool of its own"
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=120) == 128 + signal.SIGTERM
    assert not pool.exists()
