"""The endpoint's Prometheus gauges of acceptance, from vLLM's counters in this process (spec_counters.py), and
the hybrid decoder's per source (peagle_ray/hybrid.py, written by its engine core)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from peagle_ray.spec_counters import SpecStats, current_stats


class SpecStatsCollector:
    """Prometheus collector: peagle_acceptance_length and peagle_acceptance_rate{position="i"} (i from 1);
    with `by_source` (the hybrid's counts per source), peagle_source_drafts{source},
    peagle_source_acceptance_length{source} and peagle_source_acceptance_rate{source, position}.

    It reads vLLM's counters from the same registry it is registered in, so a nested collect (the registry
    collecting this collector while it reads the registry) yields nothing, and `describe` lets `register`
    learn the names without collecting.
    """

    def __init__(self, by_source: Callable[[], dict[str, SpecStats]] = dict):
        self._local = threading.local()
        self.by_source = by_source

    def describe(self):
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("peagle_acceptance_length", "")
        yield GaugeMetricFamily("peagle_acceptance_rate", "", labels=["position"])

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        if getattr(self._local, "busy", False):
            return
        self._local.busy = True
        try:
            stats = current_stats()
        finally:
            self._local.busy = False
        al = GaugeMetricFamily("peagle_acceptance_length", "Mean tokens per speculative step: 1 + accepted / drafts")
        al.add_metric([], stats.acceptance_length)
        rate = GaugeMetricFamily(
            "peagle_acceptance_rate", "Fraction of drafts whose i-th token was accepted", labels=["position"]
        )
        for i, r in enumerate(stats.acceptance_per_position, start=1):
            rate.add_metric([str(i)], r)
        yield al
        yield rate
        yield from source_gauges(self.by_source())


def source_gauges(sources: dict[str, SpecStats]):
    """The hybrid's gauges per source (nothing for any other decoder)."""
    from prometheus_client.core import GaugeMetricFamily

    if not sources:
        return
    drafts = GaugeMetricFamily(
        "peagle_source_drafts", "Drafts proposed by each source of the hybrid", labels=["source"]
    )
    al = GaugeMetricFamily(
        "peagle_source_acceptance_length", "1 + accepted / drafts, per source of the hybrid", labels=["source"]
    )
    rate = GaugeMetricFamily(
        "peagle_source_acceptance_rate",
        "Fraction of a source's drafts whose i-th token was accepted",
        labels=["source", "position"],
    )
    for source, counts in sorted(sources.items()):
        drafts.add_metric([source], counts.drafts)
        al.add_metric([source], counts.acceptance_length)
        for i, r in enumerate(counts.acceptance_per_position, start=1):
            rate.add_metric([source, str(i)], r)
    yield from (drafts, al, rate)
