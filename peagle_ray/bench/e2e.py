"""`peagle-ray bench e2e`: batch-1 greedy decode on held-out prompts, the target alone against the EAGLE-3
and P-EAGLE drafters, each at its best K (the evaluation sweep's measurement, in float32 so greedy
outputs must match the target's exactly).

    {"target_tokens_per_s": .., "eagle3": {"k", "tokens_per_s", "acceptance_length", "speedup"},
     "peagle": {.., "speedup_vs_eagle3"}, "greedy_mismatches": 0, "goals": {...}}

Goals (issue 6): P-EAGLE >= 1.8x the target alone and >= 1.3x EAGLE-3, each at its best K.
"""

from __future__ import annotations

from pathlib import Path

from peagle_ray.config import PeagleConfig


def run(cfg: PeagleConfig, drafters: dict[str, Path], k_values: list[int] | None = None) -> dict:
    from peagle_ray.eval.sweep import run_eval
    from peagle_ray.target import resolve_target_path

    results = run_eval(cfg, resolve_target_path(cfg), drafters, k_values, write_k=False)
    out = {"target": results["target"], "prompts_per_category": results["prompts_per_category"],
           "timing_prompts_per_category": results["timing_prompts"], "max_new_tokens": results["max_new_tokens"],
           "target_tokens_per_s": results["target_only"]["overall"]["tokens_per_s"],
           "greedy_mismatches": results["greedy_mismatches"], "k_values": results["k_values"]}  # fmt: skip
    for algorithm in ("eagle3", "peagle"):
        if algorithm in results:
            best = results[algorithm]["best"]["overall"]
            out[algorithm] = {"k": best["k"], "tokens_per_s": best["tokens_per_s"],
                              "acceptance_length": best["acceptance_length"], "speedup": best["speedup"],
                              "tokens_per_s_by_k": {k: r["overall"]["tokens_per_s"]
                                                    for k, r in results[algorithm]["by_k"].items()}}  # fmt: skip
    goals = {}
    if "peagle" in out:
        goals["peagle_vs_target"] = {"measured": out["peagle"]["speedup"], "goal": 1.8,
                                     "met": (out["peagle"]["speedup"] or 0) >= 1.8}  # fmt: skip
    if "peagle" in out and "eagle3" in out and out["eagle3"]["tokens_per_s"]:
        ratio = round(out["peagle"]["tokens_per_s"] / out["eagle3"]["tokens_per_s"], 3)
        out["peagle"]["speedup_vs_eagle3"] = ratio
        goals["peagle_vs_eagle3"] = {"measured": ratio, "goal": 1.3, "met": ratio >= 1.3}
    out["goals"] = goals
    return out
