"""bench adapt's pure parts (workloads, the split by prompt, the goals), and bench adapt-ablation on the session's
adaptation loop (tests/helpers/demo_loop.py). The loop bench adapt drives is tested part by part in
test_adapt.py; its figures come from running it (docs/)."""

from pathlib import Path

import pytest

from peagle_ray.bench.adapt import goals
from peagle_ray.config import ConfigError
from peagle_ray.data.public import EvalPrompt
from peagle_ray.data.workload import split_prompts, workload_prompts


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
    coding = workload_prompts("builtin-coding")  # the built-in suite's category: its prompts, no answers
    assert len(coding) == 40 and coding[0].prompt_id == "coding-000" and coding[0].category == "builtin-coding"
    assert all(m["role"] != "assistant" for p in coding for m in p.messages)
    with pytest.raises(ConfigError, match="workload must be 'humaneval', 'sharegpt-WORD' .*got 'mtbench'"):
        workload_prompts("mtbench")
    with pytest.raises(ConfigError, match="'builtin-CATEGORY' \\(one of coding, math.*got 'builtin-poetry'"):
        workload_prompts("builtin-poetry")


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


def test_ablation_variants_split_their_own_overrides_from_the_config_ones():
    from peagle_ray.bench.adapt_ablation import split_overrides

    assert split_overrides(["replay=0.5", "training.learning_rate=1e-3"]) == (
        ["training.learning_rate=1e-3"],
        {"traffic": 1.0, "replay": 0.5},
    )
    assert split_overrides([]) == ([], {"traffic": 1.0, "replay": 0.0})
    with pytest.raises(ConfigError, match="replay must be a share in .* got '1'"):
        split_overrides(["replay=1"])
    with pytest.raises(ConfigError, match="traffic must be a share .* got '0'"):
        split_overrides(["traffic=0"])


def test_the_training_mix_keeps_a_share_of_traffic_and_replays_general_records():
    from peagle_ray.bench.adapt_ablation import training_mix

    traffic = [{"id": f"t{i}"} for i in range(8)]
    general = [{"id": f"g{i}"} for i in range(6)]
    mix = training_mix(traffic, general, keep=0.5, replay=0.5, seed=0)
    assert sorted(r["id"] for r in mix) == ["g0", "g1", "g2", "g3", "t0", "t1", "t2", "t3"]
    assert sorted(r["id"] for r in training_mix(traffic, general, 1.0, 0.0, 0)) == sorted(r["id"] for r in traffic)
    with pytest.raises(ConfigError, match="replay=0.5 needs 8 general training records; the general capture has 6"):
        training_mix(traffic, general, 1.0, 0.5, 0)


def test_adapt_ablation_on_the_adaptations_own_inputs(demo_loop):
    """bench adapt-ablation on the session's adaptation (its prepared data and captured shards; the general
    side: its replayed records)."""
    from peagle_ray.bench import adapt_ablation
    from peagle_ray.config import with_values

    work = Path(demo_loop.report.json).parent
    variants = [["base"], ["decoder only", "drafter.frozen=[embed_tokens, fc]"], ["replay", "replay=0.2"]]
    cfg = with_values(demo_loop.cfg, {"capture.output_dir": str(work / "hidden")})
    ablation = adapt_ablation.run(cfg, work, variants, [2, 4])
    rows = {name: v["rows"] for name, v in ablation["variants"].items()}
    assert [r["steps"] for r in rows["base"]] == [2, 4] and set(ablation["parent"]) == {"heldout_al", "general_al"}
    assert rows["decoder only"][0]["trainable_parameters"] < rows["base"][0]["trainable_parameters"]
    assert ablation["variants"]["replay"]["train_records"] > ablation["variants"]["base"]["train_records"]
    assert all(r["heldout_al"] >= 1 and r["general_al"] >= 1 for v in rows.values() for r in v)
