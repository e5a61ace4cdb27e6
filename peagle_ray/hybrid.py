"""The hybrid decoder's rule and its counts (issue 37): a trained drafter (P-EAGLE or EAGLE-3) and suffix
decoding in one engine. Only these pure parts exist so far; the vLLM plugin that applies them in the engine's
proposal step is the next step of issue 37.

Each step, for each request, suffix decoding's draft is taken where its score (the sum of its estimated token
probabilities: arctic-inference's SuffixDecodingDraft.score) reaches the threshold - by default the drafter's
K, Arctic Inference's rule - else the drafter's. What each source drafted and what of it the target accepted
is counted per source, as vLLM counts all drafts (spec_counters.SpecStats).

    drafts, sources = choose([[5, 6], [7, 8]], [([1, 2, 3], 2.5), ([9], 0.4)], threshold=2)
    -> [[1, 2, 3], [7, 8]], ["suffix", "drafter"]
"""

from __future__ import annotations

from collections.abc import Sequence

from peagle_ray.spec_counters import SpecStats, add_lists

SOURCES = ("suffix", "drafter")


def choose(
    drafter: Sequence[list[int]], suffix: Sequence[tuple[list[int], float]], threshold: float
) -> tuple[list[list[int]], list[str]]:
    """Per request: suffix decoding's tokens when it has some and its score >= `threshold`, else the
    drafter's; with the source of each."""
    if len(drafter) != len(suffix):
        raise ValueError(f"one draft per request from each source; got {len(drafter)} and {len(suffix)}")
    drafts, sources = [], []
    for own, (tokens, score) in zip(drafter, suffix, strict=True):
        use_suffix = bool(tokens) and score >= threshold
        drafts.append(list(tokens) if use_suffix else list(own))
        sources.append("suffix" if use_suffix else "drafter")
    return drafts, sources


def count_step(
    stats: dict[str, SpecStats], sources: Sequence[str], drafted: Sequence[int], accepted: Sequence[int]
) -> None:
    """Add one verified step to `stats` ({source: SpecStats}): request i's draft of `drafted[i]` tokens came
    from `sources[i]`, and the target accepted its first `accepted[i]` tokens (the tokens it sampled, less the
    one of its own). A request that drafted nothing is not a draft.

    e.g. sources ["suffix", "drafter"], drafted [3, 2], accepted [2, 0] -> suffix: 1 draft, 3 draft tokens,
    2 accepted, per position [1, 1]; drafter: 1 draft, 2 draft tokens, 0 accepted, per position []."""
    for source, n, a in zip(sources, drafted, accepted, strict=True):
        if not 0 <= a <= n:
            raise ValueError(f"accepted tokens must be 0..{n} (the draft's length); got {a}")
        if n == 0:
            continue
        s = stats.setdefault(source, SpecStats())
        s.drafts, s.draft_tokens, s.accepted_tokens = s.drafts + 1, s.draft_tokens + n, s.accepted_tokens + a
        s.accepted_per_position = add_lists(s.accepted_per_position, [1] * a)
