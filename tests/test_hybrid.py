"""The hybrid decoder's pure parts (peagle_ray/hybrid.py): which source drafts, and the counts per source."""

import pytest

from peagle_ray.hybrid import choose, count_step
from peagle_ray.spec_counters import SpecStats


def test_suffix_drafts_where_its_score_reaches_the_threshold_else_the_drafter():
    drafts, sources = choose(
        [[5, 6], [7, 8], [1, 1], [4, 4]],
        [([1, 2, 3], 2.5), ([9], 0.4), ([], 9.0), ([2, 2], 2.0)],  # no tokens: nothing to take
        threshold=2,
    )
    assert drafts == [[1, 2, 3], [7, 8], [1, 1], [2, 2]]
    assert sources == ["suffix", "drafter", "drafter", "suffix"]
    with pytest.raises(ValueError, match="one draft per request from each source; got 1 and 2"):
        choose([[1]], [([1], 1.0), ([2], 1.0)], 1)


def test_counts_per_source_add_up_to_what_vllm_counts_over_all_drafts():
    stats: dict[str, SpecStats] = {}
    count_step(stats, ["suffix", "drafter", "drafter"], [3, 2, 0], [2, 0, 0])
    count_step(stats, ["suffix", "suffix", "drafter"], [1, 4, 2], [1, 4, 1])
    assert stats["suffix"] == SpecStats(3, 8, 7, [3, 2, 1, 1])
    assert stats["drafter"] == SpecStats(2, 4, 1, [1, 0])
    assert stats["suffix"].acceptance_length == pytest.approx(1 + 7 / 3)
    overall = stats["suffix"] + stats["drafter"]  # vLLM's own counters over every draft
    assert overall == SpecStats(5, 12, 8, [4, 2, 1, 1])
    with pytest.raises(ValueError, match=r"accepted tokens must be 0..2 \(the draft's length\); got 3"):
        count_step(stats, ["drafter"], [2], [3])
