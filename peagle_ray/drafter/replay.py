"""Offline acceptance: replay greedy speculative decoding over a sequence the target produced greedily.

At a decode step the target has seen x_0..x_{n-1} and sampled x_n; the drafter proposes K tokens; greedy
verification accepts the longest prefix of drafts equal to x_{n+1}, x_{n+2}, ...; the target's own token
follows, so decoding resumes at n + accepted + 1. Over a greedy sequence this is exactly what vLLM's
greedy verification accepts, using only the captured hidden states.

e.g. K = 3, drafts [a, b, z] against the true continuation [a, b, c] -> 2 accepted (positions 1 and 2),
the step emits 3 tokens (a, b and the target's c); the acceptance length of the step is 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peagle_ray.drafter.model import DraftCache, Drafter


@dataclass
class Acceptance:
    """Counters in vLLM's terms: drafts, accepted tokens, accepted tokens per position."""

    k: int
    drafts: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.per_position = self.per_position or [0] * self.k

    def add(self, accepted: int) -> None:
        self.drafts += 1
        self.accepted += accepted
        for i in range(accepted):
            self.per_position[i] += 1

    @property
    def acceptance_length(self) -> float:
        """AL = 1 + accepted / drafts."""
        return 1 + self.accepted / self.drafts if self.drafts else float("nan")

    def rates(self) -> list[float]:
        """Fraction of drafts whose i-th token was accepted, i = 1..K."""
        return [a / self.drafts if self.drafts else float("nan") for a in self.per_position]


@torch.no_grad()
def replay_greedy(
    drafter: Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor, start: int, k: int, acceptance: Acceptance
) -> Acceptance:
    """Replay decoding of input_ids[start:] (the target's greedy output) after the prompt input_ids[:start].

    input_ids (T,), aux_hidden (T, A): the captured record of prompt + greedy continuation.
    """
    cache = DraftCache(drafter.arch.num_layers)
    t, n = input_ids.shape[0], start
    while n + 1 < t:  # x_n is the newly sampled token; drafts are checked against x_{n+1}..
        lo = cache.length
        drafts = drafter.propose(cache, input_ids[lo + 1 : n + 1], aux_hidden[lo:n], k)
        truth = input_ids[n + 1 : n + 1 + k]
        matches = (drafts[: len(truth)] == truth).long()
        accepted = int(matches.cumprod(0).sum())
        acceptance.add(accepted)
        n += accepted + 1
    return acceptance
