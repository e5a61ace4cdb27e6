"""The endpoint's Prometheus gauges of acceptance, from vLLM's counters in this process (spec_counters.py)."""

from __future__ import annotations

import threading

from peagle_ray.spec_counters import current_stats


class SpecStatsCollector:
    """Prometheus collector: peagle_acceptance_length and peagle_acceptance_rate{position="i"} (i from 1).

    It reads vLLM's counters from the same registry it is registered in, so a nested collect (the registry
    collecting this collector while it reads the registry) yields nothing, and `describe` lets `register`
    learn the names without collecting.
    """

    def __init__(self):
        self._local = threading.local()

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
