"""`peagle-ray eval`: held-out prompts per category through vLLM with no speculation, the EAGLE-3 drafter
and the P-EAGLE drafter for each K in eval.k_values; acceptance per position, AL, tokens/s, speedups and
greedy mismatches against the target alone; per algorithm the fastest K, written to the JSON and each
drafter's config.json, and the verdict (`recommend_k`: draft at it, or not at all when it is not measurably
faster than the target alone) in the drafter's recommendation.json, which serving follows.

Each configuration is one vLLM engine in its own process (eval/compare.py, `vllm_run`), several alive side by
side: the first eval.timing_prompts of a category are timed at batch 1 by each engine in turn, the rest run
batched; acceptance counts all of them. Prompts come from eval.suite: the prepared validation
split (the prompt part of each conversation), MT-Bench or HumanEval; eval.prompts_per_category per category.

Per category and overall (eval/metrics.py): k, acceptance_per_position, acceptance_length, tokens_per_s,
baseline_tokens_per_s, speedup, greedy_mismatches; and step_cost_vs_target, what one decode step (draft +
verify) costs in target-alone steps, measured on the timing prompts: speedup = their AL / step_cost. The
table and the MLflow record: eval/report.py.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from peagle_ray.config import PeagleConfig
from peagle_ray.eval.compare import compare, drafter
from peagle_ray.eval.metrics import AlgorithmResult, SweepResult, summarize
from peagle_ray.eval.report import format_table, log_results
from peagle_ray.export.speculators import Recommendation
from peagle_ray.layout import ALGORITHMS, eval_dir, export_dir, mlflow_dir, run_name_for


def default_drafters(cfg: PeagleConfig) -> dict[str, Path]:
    """The exports of this config's training runs that exist: {algorithm: <storage>/<run name>/export}."""
    found = {a: export_dir(cfg.training.storage_path, run_name_for(cfg, a)) for a in ALGORITHMS}
    return {a: d for a, d in found.items() if (d / "config.json").is_file()}


def choose_drafters(cfg: PeagleConfig, given: dict[str, Path | None], purpose: str) -> dict[str, Path]:
    """The drafters given ({algorithm: directory or None}, e.g. --peagle / --eagle3) over the config's own
    training exports; refuses an empty set, naming what to `purpose` ("evaluate", "benchmark")."""
    drafters = default_drafters(cfg) | {a: d for a, d in given.items() if d is not None}
    if not drafters:
        raise FileNotFoundError(
            f"no drafter to {purpose}: train one (`peagle-ray train`) or pass --peagle/--eagle3 DIR"
        )
    return drafters


def eval_prompts(cfg: PeagleConfig, target_dir: Path) -> dict[str, list[list[int]]]:
    """{category: prompt token ids}, eval.prompts_per_category each, from eval.suite: the prepared validation
    split (the prompt part of each conversation), or MT-Bench / HumanEval rendered with the target's chat
    template (prompts that leave no room for eval.max_new_tokens in target.max_model_len are left out)."""
    if cfg.eval.suite != "validation":
        return _suite_prompts(cfg, target_dir)
    from peagle_ray.data.prepare import read_prepared

    path = Path(cfg.data.output_dir) / "validation.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"data.output_dir = {cfg.data.output_dir} has no validation.jsonl; run `peagle-ray data prepare` first"
        )
    prompts: dict[str, list[list[int]]] = defaultdict(list)
    for sample in read_prepared(Path(cfg.data.output_dir), "validation"):
        if 1 in sample.loss_mask and len(prompts[sample.category]) < cfg.eval.prompts_per_category:
            prompts[sample.category].append(sample.input_ids[: sample.loss_mask.index(1)])
    if not prompts:
        raise ValueError(f"data.output_dir = {cfg.data.output_dir}: the validation split has no prompts to evaluate")
    return dict(sorted(prompts.items()))


def _suite_prompts(cfg: PeagleConfig, target_dir: Path) -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    from peagle_ray.data.prepare import render
    from peagle_ray.data.public import EVAL_SUITES

    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=cfg.target.trust_remote_code)
    room = cfg.target.max_model_len - cfg.eval.max_new_tokens
    prompts: dict[str, list[list[int]]] = defaultdict(list)
    for item in EVAL_SUITES[cfg.eval.suite]():
        ids = render(tokenizer, item.messages, add_generation_prompt=True)
        if len(ids) <= room and len(prompts[item.category]) < cfg.eval.prompts_per_category:
            prompts[item.category].append(ids)
    if not prompts:
        raise ValueError(
            f"eval.suite = {cfg.eval.suite}: no prompt leaves eval.max_new_tokens = {cfg.eval.max_new_tokens} "
            f"of room in target.max_model_len = {cfg.target.max_model_len}"
        )
    return dict(sorted(prompts.items()))


def set_drafter_k(drafter_dir: Path, k: int) -> None:
    """Write the recommended K into the exported drafter's config (serving's default K)."""
    config_file = Path(drafter_dir) / "config.json"
    config = json.loads(config_file.read_text())
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = k
    config_file.write_text(json.dumps(config, indent=2))


def write_recommendation(drafter_dir: Path, recommendation: Recommendation) -> None:
    """The fastest K into the drafter's config.json (so vLLM, or a user forcing K, gets the best one) and the
    verdict into its recommendation.json, which serving reads: no drafting means the target alone is served."""
    set_drafter_k(drafter_dir, recommendation.k)
    recommendation.write(Path(drafter_dir))


def run_eval(
    cfg: PeagleConfig,
    target_dir: Path,
    drafters: dict[str, Path],
    k_values: list[int] | None = None,
    progress: bool = True,
    write_k: bool = True,
) -> SweepResult:
    """The sweep; drafters = {"peagle": dir, "eagle3": dir} (either may be missing). write_k: store each
    algorithm's recommended K in its drafter's config.json."""
    prompts = eval_prompts(cfg, target_dir)
    k_values = sorted(k_values or cfg.eval.k_values)
    plan = [(alg, k) for alg in ALGORITHMS if alg in drafters for k in k_values]
    bar = tqdm(total=1 + len(plan), desc="eval", unit="engine", disable=not progress)

    def advance(what: str) -> None:
        bar.update(1)
        bar.set_postfix_str(what)

    bar.set_postfix_str("target only")
    judged = compare(
        cfg,
        target_dir,
        [drafter(f"{a}@{k}", drafters[a], k) for a, k in plan],
        prompts,
        cfg.eval.timing_prompts,
        advance,
    )
    bar.update(1)
    bar.close()
    results = SweepResult(
        target=str(target_dir),
        suite=cfg.eval.suite,
        categories=list(prompts),
        k_values=k_values,
        prompts_per_category=cfg.eval.prompts_per_category,
        timing_prompts=cfg.eval.timing_prompts,
        max_new_tokens=cfg.eval.max_new_tokens,
        dtype=cfg.target.dtype,
    )
    alone = summarize(0, judged.baseline, judged.baseline)
    results.target_only = {c: {"tokens_per_s": r["tokens_per_s"]} for c, r in alone.items()}
    for algorithm, k in plan:
        entry = results.algorithms.setdefault(algorithm, AlgorithmResult(str(drafters[algorithm])))
        entry.by_k[k] = judged.rows(f"{algorithm}@{k}")
    for algorithm, entry in results.algorithms.items():
        recommendation = entry.decide()
        if write_k:
            write_recommendation(drafters[algorithm], recommendation)
    if "peagle" in results.algorithms and "eagle3" in results.algorithms:
        ours, theirs = results.algorithms["peagle"].best, results.algorithms["eagle3"].best
        for category, row in ours.items():
            other = theirs[category]["tokens_per_s"]
            row["speedup_vs_eagle3"] = round(row["tokens_per_s"] / other, 3) if other else None
    return results


@dataclass(frozen=True)
class Evaluation:
    """What `peagle-ray eval` produced: the sweep, its table, its JSON file, the MLflow runs it logged into
    ({algorithm: run id}) and where."""

    results: SweepResult
    table: str
    json: Path
    runs: dict[str, str]
    tracking_uri: str


def evaluate(cfg: PeagleConfig, drafters: dict[str, Path], k_values: list[int] | None = None) -> Evaluation:
    """`peagle-ray eval`: measure acceptance per position, tokens/s and speedup against the target alone.

    One vLLM engine per configuration (target alone, then each algorithm at each K) on eval.suite's prompts;
    writes the recommended K into each drafter's config, <storage>/<eval_name>/eval.json (before MLflow, so a
    tracking failure loses no measurement) and eval/* metrics and plots to MLflow. The demo's evaluation too."""
    from peagle_ray.target import resolve_target_path
    from peagle_ray.tracking import tracking_uri

    results = run_eval(cfg, resolve_target_path(cfg), drafters, k_values)
    storage = Path(cfg.training.storage_path)
    work_dir = eval_dir(storage, results.suite)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "eval.json").write_text(json.dumps(results.to_json(), indent=2))
    with tracking_uri(cfg, mlflow_dir(storage)) as uri:
        runs = log_results(uri, cfg, results, drafters, work_dir)
    return Evaluation(results, format_table(results), work_dir / "eval.json", runs, uri)
