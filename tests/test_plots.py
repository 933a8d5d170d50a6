"""Benchmark reports drawn as PNGs: `maru bench --plot` and the e2e benchmark's figure."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

import maru.cli.bench
from maru.cli import main
from maru.cli.bench import run_bench
from maru.cli.plots import PlottingUnavailableError, bench_plot, e2e_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL_SIZES = (64 * 1024, 256 * 1024)
ROOT = Path(__file__).parent.parent
E2E_REPORT = ROOT / "docs" / "results" / "e2e_vllm.json"
"""The measured report the README's figure is drawn from (benchmarks/results/ is each
machine's own output, not committed)."""


def png_shape(path: Path) -> tuple[int, ...]:
    """(height, width, channels) of the PNG at `path`, after checking its magic bytes."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC
    return imread(path).shape


@pytest.fixture(scope="module")
def mock_report() -> dict:
    """A real `maru bench` report of the mock backend, at two small object sizes."""
    return run_bench("mock", sizes=SMALL_SIZES, capacity=8 << 20, progress=lambda line: None)


def test_bench_plot_writes_a_png_of_a_real_report(mock_report, tmp_path) -> None:
    path = tmp_path / "bench.png"
    bench_plot(mock_report, path)
    height, width, _ = png_shape(path)
    assert height > 0 and width > 0


def test_bench_plot_draws_one_panel_per_backend(mock_report, tmp_path) -> None:
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    bench_plot([mock_report], one)
    bench_plot([mock_report, mock_report | {"backend": "again"}], two)
    assert png_shape(two)[1] > png_shape(one)[1] * 1.5


def test_e2e_plot_draws_the_committed_report(tmp_path) -> None:
    path = tmp_path / "e2e.png"
    e2e_plot(json.loads(E2E_REPORT.read_text()), path)
    height, width, _ = png_shape(path)
    assert height > 0 and width > 0


def test_e2e_plot_draws_whatever_engines_the_report_holds(tmp_path) -> None:
    report = {
        "ttft_median_s": {"none": 2.5, "maru_hit": 0.02, "someone_else": 0.4},
        "tokens_loaded": {"maru": [992, 992]},
        "prompts": 2,
        "prompt_tokens": 1025,
        "model": {"layers": 2, "hidden": 64},
    }
    path = tmp_path / "e2e.png"
    e2e_plot(report, path)
    assert png_shape(path)[0] > 0


def test_plots_without_matplotlib_say_how_to_install_it(mock_report, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(PlottingUnavailableError, match=r"pip install 'maru\[plot\]'"):
        bench_plot(mock_report, tmp_path / "bench.png")
    assert not (tmp_path / "bench.png").exists()


def test_maru_bench_plot_writes_the_figure(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(
        maru.cli.bench, "run_bench", functools.partial(run_bench, sizes=SMALL_SIZES)
    )
    path = tmp_path / "bench.png"
    code = main(["bench", "--backend", "mock", "--plot", str(path)])
    out, _ = capsys.readouterr()
    assert code == 0
    assert f"plot written to {path}" in out
    assert png_shape(path)[0] > 0


@pytest.mark.parametrize(
    ("name", "expected"),
    [("missing/bench.png", "directory '{dir}' does not exist"), ("bench.svg", "must end in .png")],
)
def test_maru_bench_plot_refuses_a_bad_path_before_measuring(
    capsys, tmp_path, monkeypatch, name, expected
) -> None:
    monkeypatch.setattr(
        maru.cli.bench, "run_bench", lambda *args, **kwargs: pytest.fail("measured")
    )
    path = tmp_path / name
    code = main(["bench", "--plot", str(path)])
    _, err = capsys.readouterr()
    assert code == 2
    assert f"plot path '{path}'" in err
    assert expected.format(dir=path.parent) in err
    assert "Traceback" not in err


def test_maru_bench_without_matplotlib_exits_before_measuring(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(
        maru.cli.bench, "run_bench", lambda *args, **kwargs: pytest.fail("measured")
    )
    code = main(["bench", "--plot", str(tmp_path / "bench.png")])
    _, err = capsys.readouterr()
    assert code == 1
    assert "pip install 'maru[plot]'" in err


def run_e2e_benchmark(*argv: str):
    """benchmarks/e2e_vllm.py with `argv`, in a process of its own, as `make bench` runs it."""
    script = ROOT / "benchmarks" / "e2e_vllm.py"
    return subprocess.run(
        [sys.executable, str(script), *argv], capture_output=True, text=True, timeout=300
    )


def test_e2e_benchmark_redraws_its_plot_from_the_json_without_engines(tmp_path) -> None:
    report = tmp_path / "e2e.json"
    report.write_text(E2E_REPORT.read_text())
    done = run_e2e_benchmark("--plot-only", "--output", str(report))
    assert done.returncode == 0, done.stderr
    assert png_shape(tmp_path / "e2e.png")[0] > 0, "by default the PNG lies beside the JSON"


def test_e2e_benchmark_refuses_a_bad_plot_path_before_any_engine(tmp_path) -> None:
    path = tmp_path / "missing" / "e2e.png"
    done = run_e2e_benchmark("--plot-only", "--output", str(E2E_REPORT), "--plot", str(path))
    assert done.returncode == 2
    assert f"directory '{path.parent}' does not exist" in done.stderr
    assert "Traceback" not in done.stderr
