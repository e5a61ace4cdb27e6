"""`peagle-ray bench e2e`: batch-1 greedy decode on held-out prompts, the target alone against the EAGLE-3
and P-EAGLE drafters, each at its best K (the evaluation sweep's measurement, in float32 so greedy
outputs must match the target's exactly).

    {"target_tokens_per_s": .., "eagle3": {"k", "tokens_per_s", "acceptance_length", "speedup"},
     "peagle": {.., "speedup_vs_eagle3"}, "greedy_mismatches": 0, "goals": {...}}

Goals (bench/goals.py E2E): P-EAGLE's speedup over the target alone and over EAGLE-3, each at its best K. Each goal also
says what it would take: a decode step costs `step_cost_vs_target` target-alone steps (measured), so
P-EAGLE's speedup is its AL / step cost, and the AL it needs at that step cost is goal x step cost (vs
EAGLE-3: goal x step cost x EAGLE-3's speedup). An AL above K + 1 cannot be reached at that K.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from peagle_ray.bench.goals import E2E
from peagle_ray.config import PeagleConfig
from peagle_ray.options import Opt


def run(
    cfg: PeagleConfig,
    drafters: dict[str, Path],
    k_values: Annotated[list[int] | None, Opt("K values (default: eval.k_values).", flag="--k")] = None,
) -> dict:
    from peagle_ray.eval.sweep import run_eval
    from peagle_ray.target import resolve_target_path

    results = run_eval(cfg, resolve_target_path(cfg), drafters, k_values, write_k=False)
    out: dict[str, Any] = {
        "target": results.target,
        "prompts_per_category": results.prompts_per_category,
        "timing_prompts_per_category": results.timing_prompts,
        "max_new_tokens": results.max_new_tokens,
        "target_tokens_per_s": results.target_only["overall"]["tokens_per_s"],
        "greedy_mismatches": results.greedy_mismatches,
        "k_values": results.k_values,
    }
    for algorithm in ("eagle3", "peagle"):
        if algorithm in results.algorithms:
            entry = results.algorithms[algorithm]
            best = entry.best["overall"]
            out[algorithm] = {
                "k": best["k"],
                "tokens_per_s": best["tokens_per_s"],
                "acceptance_length": best["acceptance_length"],
                "speedup": best["speedup"],
                "step_cost_vs_target": best["step_cost_vs_target"],
                "tokens_per_s_by_k": {k: r["overall"]["tokens_per_s"] for k, r in entry.by_k.items()},
            }
    goals = {}
    if "peagle" in out:
        ours = out["peagle"]
        goals["peagle_vs_target"] = goal(ours["speedup"], E2E["peagle_vs_target"], ours, 1.0)
        if "eagle3" in out and out["eagle3"]["tokens_per_s"]:
            ratio = round(ours["tokens_per_s"] / out["eagle3"]["tokens_per_s"], 3)
            ours["speedup_vs_eagle3"] = ratio
            goals["peagle_vs_eagle3"] = goal(ratio, E2E["peagle_vs_eagle3"], ours, out["eagle3"]["speedup"])
    out["goals"] = goals
    return out


def goal(measured: float | None, target: float, peagle: dict, baseline_speedup: float | None) -> dict:
    """A goal's verdict and the P-EAGLE AL it needs at the measured step cost, e.g. goal 1.8x at step cost
    1.4 vs the target alone (baseline_speedup 1.0) -> AL 2.52 needed."""
    cost = peagle["step_cost_vs_target"]
    needed = round(target * cost * baseline_speedup, 3) if cost and baseline_speedup else None
    return {
        "measured": measured,
        "goal": target,
        "met": (measured or 0) >= target,
        "acceptance_length": peagle["acceptance_length"],
        "acceptance_length_needed": needed,
        "max_acceptance_length": peagle["k"] + 1,
    }
