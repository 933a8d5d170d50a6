"""The `maru` command: info, config show/check, JSON output, and exit codes."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from maru.cli import main
from maru.cli.bench import format_report, run_bench
from tests.cpu_flags import cpu_flags
from tests.redis_server import free_port


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_json_lists_backends_with_their_distributions(capsys) -> None:
    code, out, _ = run_cli(capsys, "info", "--json")
    info = json.loads(out)
    assert code == 0
    backends = {b["name"]: b["distribution"] for b in info["backends"]}
    assert backends["mock"] == "maru"
    assert backends["dirstore"] == "maru-example-plugin"
    assert {"name": "dirstore", "distribution": "maru-example-plugin", "version": "0.1.0"} in info[
        "plugins"
    ]
    assert info["version"]


def test_info_says_whether_loads_sum_as_they_copy_on_this_cpu(capsys) -> None:
    """Streaming stores on x86-64; the checksum computed by the copies where the CPU
    has AVX2 (as /proc/cpuinfo says), so a slow verified load is explained."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    sums = x86 and "avx2" in cpu_flags()
    code, out, _ = run_cli(capsys, "info", "--json")
    assert code == 0
    assert json.loads(out)["cpu_copies"] == {"streaming": x86, "sums_as_copied": sums}
    _, text, _ = run_cli(capsys, "info")
    assert ("checksums summed as they copy (AVX2)" in text) == sums


def test_a_reader_that_goes_away_gets_no_traceback() -> None:
    """`maru info | head -1`: the pipe closes before maru has written; the command
    still exits with its own code and says nothing on stderr."""
    process = subprocess.Popen(
        [sys.executable, "-m", "maru", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()
    _, err = process.communicate(timeout=60)
    assert (process.returncode, err.decode()) == (0, "")


def test_info_text(capsys) -> None:
    code, out, _ = run_cli(capsys, "info")
    assert code == 0
    assert "dirstore" in out and "maru-example-plugin" in out


def test_config_show_gives_each_value_and_its_source(capsys, tmp_path, monkeypatch) -> None:
    path = tmp_path / "maru.yaml"
    path.write_text("capacity: 1GiB\n")
    monkeypatch.setenv("MARU_NAMESPACE", "team-a")
    code, out, _ = run_cli(capsys, "config", "show", "--config", str(path), "--json")
    shown = json.loads(out)
    assert code == 0
    assert shown["capacity"] == {"value": 2**30, "source": f"file {path}"}
    assert shown["namespace"] == {"value": "team-a", "source": "env MARU_NAMESPACE"}
    assert shown["chunk_tokens"] == {"value": 256, "source": "default"}
    assert shown["shm.name"] == {"value": "default", "source": "default"}
    code, out, _ = run_cli(capsys, "config", "show", "--config", str(path))
    assert "env MARU_NAMESPACE" in out and "capacity" in out


def test_config_check_accepts_a_good_file(capsys, tmp_path) -> None:
    path = tmp_path / "maru.toml"
    path.write_text('backend = "mock"\ncapacity = "64MiB"\n')
    code, out, _ = run_cli(capsys, "config", "check", str(path), "--json")
    assert code == 0
    assert json.loads(out) == {"file": str(path), "valid": True, "backend": "mock"}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("capacity: 1G\ncolour: blue\n", "colour = 'blue' (from file {path}): unknown key"),
        (
            "mock:\n  fail_rat: 0.5\n",
            "mock.fail_rat = 0.5 (from file {path}): unknown key; allowed: name, fail_rate",
        ),
        ("capacity: 12 parsecs\n", "capacity = '12 parsecs' (from file {path}): not a size"),
        ("capacity: -1G\n", "capacity = '-1G' (from file {path}): must be greater than zero"),
        (
            "backend: nosuch\n",
            "backend = 'nosuch' (from file {path}): no backend named 'nosuch' is "
            "installed; allowed: cxl, dirstore, disk, mock, redis, shm, tiered",
        ),
        (
            "chunk_tokens: [256]\n",
            "chunk_tokens = [256] (from file {path}): Input should be a valid integer",
        ),
        (
            "s3:\n  url: s3://bucket\n",
            "s3 = {{'url': 's3://bucket'}} (from file {path}): unknown key; allowed: backend",
        ),
    ],
)
def test_bad_configs_exit_2_with_one_clear_paragraph(capsys, tmp_path, body, expected) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    code, out, err = run_cli(capsys, "config", "check", str(path))
    assert code == 2
    assert expected.format(path=path) in err
    assert err.startswith("maru: error: invalid maru config: ")
    assert err.count("\n") == 1
    code, out, _ = run_cli(capsys, "config", "check", str(path), "--json")
    assert code == 2
    assert expected.format(path=path) in json.loads(out)["error"]["message"]


def test_a_bad_environment_exits_2_from_config_show(capsys, monkeypatch) -> None:
    monkeypatch.setenv("MARU_CAPACITY", "zero")
    code, _, err = run_cli(capsys, "config", "show")
    assert code == 2
    assert "capacity = 'zero' (from env MARU_CAPACITY): not a size" in err


def test_the_installed_command_never_prints_a_traceback(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    for argv in (["config", "check", str(path)], ["info", "--bogus"], ["nosuch"]):
        done = subprocess.run(
            [sys.executable, "-m", "maru", *argv], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, argv
        assert "Traceback" not in done.stderr
        assert "error" in done.stderr


def set_calls(client) -> int:
    """How many SET commands the server has run."""
    return client.info("commandstats").get("cmdstat_set", {}).get("calls", 0)


def test_bench_redis_measures_the_server_the_config_names(redis_server, monkeypatch) -> None:
    import redis

    monkeypatch.setenv("MARU_REDIS__URL", redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    sets_before = set_calls(client)
    report = run_bench("redis", sizes=(64 * 1024,), capacity=2**20, progress=lambda line: None)
    assert [row["size"] for row in report["sizes"]] == [64 * 1024]
    sets = set_calls(client) - sets_before
    assert sets >= 200 + 2000, "every put of the benchmark went to the configured server"
    assert client.keys("maru:bench-*") == [], "the benchmark deletes what it wrote"


def test_bench_redis_names_an_unreachable_server_from_the_config_file(capsys, tmp_path) -> None:
    path = tmp_path / "maru.yaml"
    url = f"redis://127.0.0.1:{free_port()}/0"
    path.write_text(f"redis:\n  url: {url}\n")
    code, _, err = run_cli(capsys, "bench", "--backend", "redis", "--config", str(path))
    assert code == 1
    assert url.removesuffix("/0") in err and "Traceback" not in err


def test_bench_measures_a_plugin_backend_by_name(capsys, tmp_path) -> None:
    """The example plugin declares no private store: the benchmark measures the
    configured one under a namespace of its own, and deletes what it wrote."""
    objects = tmp_path / "objects"
    config = tmp_path / "maru.yaml"
    config.write_text(f"dirstore:\n  path: {objects}\n")
    bench = ("bench", "--backend", "dirstore", "--size", "64KiB", "--capacity", "16MiB")
    code, out, err = run_cli(capsys, *bench, "--config", str(config), "--json")
    assert code == 0, err
    (report,) = json.loads(out)
    assert report["backend"] == "dirstore" and report["first_pass"] is None
    assert [row["size"] for row in report["sizes"]] == [64 * 1024]
    assert report["sizes"][0]["put_gbps"] > 0 and report["sizes"][0]["get_into_gbps"] > 0
    assert set(report["latency"]) == {"contains_128_us", "put_4k_us", "get_4k_us"}
    assert [path for path in objects.rglob("*") if path.is_file()] == []
    code, out, _ = run_cli(capsys, *bench, "--config", str(config))
    assert code == 0 and "backend dirstore: throughput in GB/s" in out
    assert "first pass" not in out


def test_bench_refuses_an_unknown_backend_listing_the_installed_ones(capsys) -> None:
    code, _, err = run_cli(capsys, "bench", "--backend", "mock", "--backend", "nosuch")
    assert code == 2
    assert "no backend named 'nosuch' is installed" in err
    assert "cxl, dirstore, disk, mock, redis, shm, tiered" in err
    assert "mock:" not in err, "nothing was measured before the unknown name was refused"


def test_bench_measures_the_configured_backend_by_default(capsys, monkeypatch) -> None:
    monkeypatch.setenv("MARU_BACKEND", "mock")
    code, out, err = run_cli(capsys, "bench", "--size", "64KiB", "--capacity", "16MiB")
    assert code == 0 and "backend mock: throughput" in out
    assert "mock: 64 KiB objects" in err


@pytest.mark.parametrize("bad", ["0", "12 parsecs", "-1K"])
def test_bench_sizes_are_validated(capsys, bad) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", f"--size={bad}"])
    assert exited.value.code == 2
    assert f"argument --size: {bad!r}" in capsys.readouterr().err


def test_bench_disk_measures_plain_files_on_the_same_filesystem(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    report = run_bench("disk", sizes=(64 * 1024,), capacity=8 << 20, progress=lambda line: None)
    (row,) = report["sizes"]
    assert row["file_write_gbps"] > 0 and row["file_read_gbps"] > 0
    assert "beside plain files of the same size" in format_report(report)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == [], "the benchmark removes its store and its plain files"


def test_bench_of_a_store_in_memory_has_no_file_baseline() -> None:
    report = run_bench("mock", sizes=(64 * 1024,), capacity=8 << 20, progress=lambda line: None)
    assert report["sizes"][0]["file_write_gbps"] is None
    assert "plain files" not in format_report(report)
