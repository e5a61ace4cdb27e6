"""bench adapt's pure parts: workloads, the split by prompt, the goals. The loop it drives is tested end to end in
test_adapt.py; its figures come from running it (README)."""

import pytest

from peagle_ray.bench.adapt import goals, split_prompts, workload_prompts
from peagle_ray.config import ConfigError
from peagle_ray.data.public import EvalPrompt


def test_split_is_by_prompt_stable_and_disjoint():
    prompts = [EvalPrompt(f"p{i}", "w", [{"role": "user", "content": str(i)}]) for i in range(200)]
    train, heldout = split_prompts(prompts, 0.3, 1000, 1000)
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in heldout}
    assert len(train) + len(heldout) == 200 and 40 < len(heldout) < 80
    assert split_prompts(list(reversed(prompts)), 0.3, 1000, 1000)[1] == list(reversed(heldout))  # by id, not order
    capped = split_prompts(prompts, 0.3, 10, 5)
    assert capped == (train[:10], heldout[:5])


def test_workloads_are_named_and_humaneval_reads_offline():
    assert len(workload_prompts("humaneval")) == 164
    with pytest.raises(ConfigError, match="workload must be 'humaneval' or 'sharegpt-WORD'.*got 'mtbench'"):
        workload_prompts("mtbench")


def test_goals_compare_within_the_run():
    row = lambda al, tps, speedup, wrong=0: {  # noqa: E731
        "acceptance_length": al,
        "tokens_per_s": tps,
        "speedup": speedup,
        "greedy_mismatches": wrong,
    }
    result = {
        "heldout": {
            "adapted": {**row(2.2, 30.0, 1.6), "speedup_vs_unadapted": 1.5},
            "unadapted": row(1.2, 20.0, 1.07),
            "suffix": row(1.9, 28.0, 1.5),
        },
        "general": {"parent": {"acceptance_length": 1.20}, "new": {"acceptance_length": 1.17}},
    }
    verdict = goals(result)
    assert {k: v["met"] for k, v in verdict.items()} == {
        "acceptance_length": True,
        "speedup_vs_target": True,
        "speedup_vs_unadapted": True,
        "ahead_of_suffix": True,
        "general_al_drop": False,
        "greedy_mismatches": True,
    }
    assert verdict["general_al_drop"]["measured"] == 0.03
    result["heldout"]["suffix"] = {"skipped": "not installed"}
    assert goals(result)["ahead_of_suffix"] == {"measured": None, "met": None}
