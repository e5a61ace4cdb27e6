"""Speculative-decoding statistics from vLLM's counters (serving's JSON and gauges, evaluation's tables).

vLLM counts drafts, draft tokens, accepted tokens and accepted tokens per position
(`vllm:spec_decode_*`). From them: acceptance at position i = accepted_per_pos[i] / drafts (the fraction of
drafts whose i-th token was accepted) and AL = 1 + accepted / drafts.

e.g. 10 drafts, accepted per position [8, 5, 1] -> acceptance [0.8, 0.5, 0.1], AL = 1 + 14/10 = 2.4.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PREFIX = "vllm:spec_decode_"


Counters = dict[str, Any]  # {name without PREFIX: an int, or a list of ints per draft position}


@dataclass
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "acceptance_per_position": self.acceptance_per_position,
            "acceptance_length": self.acceptance_length,
        }

    @staticmethod
    def from_counters(counters: Counters) -> SpecStats:
        """From {name without the vllm:spec_decode_ prefix: value}, summed over engines already."""
        return SpecStats(
            int(counters.get("num_drafts", 0)),
            int(counters.get("num_draft_tokens", 0)),
            int(counters.get("num_accepted_tokens", 0)),
            [int(v) for v in counters.get("num_accepted_tokens_per_pos", [])],
        )

    def plus(self, other: SpecStats, sign: int = 1) -> SpecStats:
        """Counts added (sign -1: subtracted) field by field."""
        return SpecStats(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted_tokens + sign * other.accepted_tokens,
            add_lists(self.accepted_per_position, other.accepted_per_position, sign),
        )

    __add__ = plus

    def minus(self, before: SpecStats) -> SpecStats:
        """The counts accumulated since `before` (counters only grow)."""
        return self.plus(before, -1)


def add_lists(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """a + sign * b, the shorter padded with zeros: e.g. [3, 1] + [2, 1, 1] -> [5, 2, 1]."""
    n = max(len(a), len(b))
    return [x + sign * y for x, y in zip(list(a) + [0] * (n - len(a)), list(b) + [0] * (n - len(b)), strict=True)]


def counters_from_snapshot(metrics) -> Counters:
    """vLLM's `get_metrics()` / `get_metrics_snapshot()` list -> summed spec-decode counters."""
    counters: Counters = {}
    for metric in metrics:
        if not metric.name.startswith(PREFIX):
            continue
        name = metric.name[len(PREFIX) :]
        values = getattr(metric, "values", None)
        if values is not None:
            counters[name] = add_lists(counters.get(name, []), values)
        else:
            counters[name] = int(counters.get(name, 0)) + int(metric.value)
    return counters


def current_stats() -> SpecStats:
    """This process's vLLM counters (the engine front-end records them in the Prometheus registry)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return SpecStats.from_counters(counters_from_snapshot(get_metrics_snapshot()))
