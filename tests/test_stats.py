"""The statistics table (`maru.vllm.stats`): one definition of every statistic, from which
the connector's stats and its Prometheus metrics are made."""

from __future__ import annotations

from maru.vllm import metrics, stats


def test_every_statistic_is_in_the_table_once() -> None:
    defined = [value for value in vars(stats).values() if isinstance(value, stats.Stat)]
    assert sorted(s.key for s in defined) == sorted(s.key for s in stats.TABLE)
    assert len({s.key for s in stats.TABLE}) == len(stats.TABLE)


def test_every_exported_statistic_has_one_metric_and_help() -> None:
    exported = [*metrics.COUNTERS, *metrics.LATENCIES, *metrics.GAUGES]
    names = [s.metric for s in exported]
    assert all(name.startswith("vllm:maru_") for name in names)
    assert len(set(names)) == len(names)
    assert {s.metric for s in metrics.ERRORS} == {"lookup", "load", "save"}
    assert all(s.help for s in stats.TABLE)
