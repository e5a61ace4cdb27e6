"""`peagle-ray bench ablation` and `peagle-ray bench learning-curve`: what a drafter learns per training budget.

Both train in one process on the offline shards (capture.output_dir, after `peagle-ray data capture`) with the
Ray Train job's own step (`train_step`, one worker) and validation (`validate`: per-depth accuracy and offline
greedy acceptance per position on the validation split, which equals vLLM's counters), so a figure here is
what the job reaches with one worker at the same budget and seeds.

ablation - one run per variant (dotted config overrides on top of the config), same data, steps and seeds:
    {"steps", "baseline": NAME, "variants": {NAME: {"overrides", "val_acceptance_length", "val_acceptance_per_position",
     "train_tokens", "train_seconds", "tokens_per_s", "trainable_parameters", "acc_by_depth"}}}

learning-curve - per algorithm (or per recipe, `--variant NAME OVERRIDE...`) one run to the largest budget (its
cosine schedule ends there), measured at each budget: validation AL (offline replay) and, for eval.suite other than "validation", the suite's AL from stock
vLLM serving the checkpoint exported at that budget, against training tokens (base positions):
    {"budgets", "suite", "curves": {algorithm: [{"steps", "train_tokens", "val_acceptance_length", "suite_acceptance_length",
     "suite_acceptance_per_position", ...}, ...]}, "plot"}
Both are logged to MLflow through tracking.py (a run per variant / algorithm, metrics against training tokens,
the plot and the JSON as artifacts).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch

from peagle_ray.config import PeagleConfig, with_overrides, with_values
from peagle_ray.layout import VAL_ACCEPTANCE_LENGTH, acceptance_metric, bench_dir, mlflow_dir
from peagle_ray.options import Opt

if TYPE_CHECKING:
    from peagle_ray.capture.pipeline import Record

Progress = Callable[[str], None]


def split_records(cfg: PeagleConfig, max_validation: int | None) -> tuple[list[Record], list[Record]]:
    """(train, validation) records from the offline shards; refuses an empty split naming the field."""
    from peagle_ray.capture.pipeline import read_offline

    records = list(read_offline(Path(cfg.capture.output_dir)))
    train = [r for r in records if r["split"] == "train"]
    validation = [r for r in records if r["split"] == "validation"][:max_validation]
    if not train:
        raise ValueError(f"capture.output_dir = {cfg.capture.output_dir} holds no training records")
    if not validation:
        raise ValueError(
            f"capture.output_dir = {cfg.capture.output_dir} holds no validation records; "
            f"raise data.validation_fraction (got {cfg.data.validation_fraction}) and prepare again"
        )
    return train, validation


def initial_drafter(cfg: PeagleConfig):
    """(drafter, teacher) as the training job builds them before its first step (training.init_from applied),
    after check_inputs."""
    from peagle_ray.drafter.build import drafter_for_target
    from peagle_ray.train.job import check_inputs

    inputs = check_inputs(cfg)
    drafter, teacher, _ = drafter_for_target(
        inputs.info.path,
        cfg.drafter,
        inputs.data.token_counts(),
        len(inputs.aux_layer_ids),
        torch.Generator().manual_seed(cfg.training.seed),
        init_from=cfg.training.init_from,
        feature_scale=None if inputs.feature_scale is None else torch.tensor(inputs.feature_scale),
    )
    return drafter, teacher


def validation_row(cfg: PeagleConfig, drafter, teacher, validation: list[Record]) -> dict:
    """The job's validation of `drafter` on `validation` (seeded with training.seed), as a benchmark row's
    val_acceptance_length, val_acceptance_per_position and val_acc_by_depth."""
    from peagle_ray.train.worker import validate

    val = validate(drafter, teacher, validation, cfg, torch.Generator().manual_seed(cfg.training.seed))
    return {
        "val_acceptance_length": round(val[VAL_ACCEPTANCE_LENGTH], 4),
        "val_acceptance_per_position": [round(val[acceptance_metric(i + 1)], 4) for i in range(cfg.drafter.num_depths)],
        "val_acc_by_depth": [
            round(val.get(f"val/acc_depth_{d}", math.nan), 4) for d in range(cfg.drafter.trained_depths)
        ],
    }


def train_and_measure(
    cfg: PeagleConfig,
    train: list[Record],
    validation: list[Record],
    budgets: list[int],
    measure: Callable[[object, object, int], dict] | None = None,
    progress: Progress = print,
) -> list[dict]:
    """Train one drafter for max(budgets) steps (cfg.training.max_steps is set to that by the caller), cycling
    through `train` in order, cfg.training.sequences_per_step records a step; at each budget validate, call
    `measure(drafter, teacher, steps)` for extra figures, and append a row. Budget 0 is the untrained drafter."""
    from peagle_ray.train.step import drafter_step, train_loop
    from peagle_ray.train.worker import to_sequence

    tcfg = cfg.training
    drafter, teacher = initial_drafter(cfg)
    generator = torch.Generator().manual_seed(tcfg.seed + 1)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    rows, tokens, seconds, per_step = [], 0, 0.0, tcfg.sequences_per_step
    if 0 in budgets:  # the untrained drafter (e.g. drafter.init_from_target against a random start)
        row = {"steps": 0, "train_tokens": 0, "epochs": 0.0, "trainable_parameters": trainable,
               **validation_row(cfg, drafter, teacher, validation)}  # fmt: skip
        if measure is not None:
            row.update(measure(drafter, teacher, 0))
        progress(json.dumps({"algorithm": cfg.drafter.algorithm, **row}))
        rows.append(row)
    if max(budgets) == 0:
        return rows
    step_fn = drafter_step(drafter, teacher, cfg.drafter, tcfg, generator)
    for done in train_loop(drafter, train, tcfg, step_fn, max(budgets), to_sequence):
        step, stats = done.step - 1, done.stats
        seconds += done.seconds
        tokens += stats.positions
        if step + 1 not in budgets:
            continue
        row = {
            "steps": step + 1,
            "train_tokens": tokens,
            "epochs": round((step + 1) * per_step / len(train), 2),
            "train_seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / seconds, 1),
            "trainable_parameters": trainable,
            "train_loss": round(stats.loss, 4),
            **validation_row(cfg, drafter, teacher, validation),
        }
        if measure is not None:
            row.update(measure(drafter, teacher, step + 1))
        progress(json.dumps({"algorithm": cfg.drafter.algorithm, **row}))
        rows.append(row)
    return rows


def suite_measure(cfg: PeagleConfig, work_dir: Path) -> Callable[[object, object, int], dict]:
    """measure(drafter, teacher, steps): export the drafter and read stock vLLM's acceptance on eval.suite (greedy,
    eval.max_new_tokens, eval.prompts_per_category per category, K = drafter.num_depths)."""
    from peagle_ray.eval.compare import run_engine
    from peagle_ray.eval.sweep import eval_prompts
    from peagle_ray.export.speculators import export_drafter, read_drafter, speculative_config
    from peagle_ray.spec_counters import SpecStats
    from peagle_ray.train.job import check_inputs

    inputs = check_inputs(cfg)
    target_dir = inputs.info.path
    prompts = eval_prompts(cfg, target_dir)
    k = cfg.drafter.num_depths

    def measure(drafter, teacher, steps: int) -> dict:
        out = export_drafter(
            drafter, work_dir / f"{cfg.drafter.algorithm}-{steps}", target_dir, inputs.aux_layer_ids, k
        )
        run = run_engine(cfg, target_dir, speculative_config(read_drafter(out), k), prompts, timing_prompts=0)
        counters = sum((SpecStats(**c["counters"]) for c in run.acceptance.values()), SpecStats())
        return {
            "suite_acceptance_length": round(counters.acceptance_length, 4),
            "suite_acceptance_per_position": [round(r, 4) for r in counters.acceptance_per_position],
        }

    return measure


def named_variants(variants: dict[str, list[str]] | list[list[str]] | None) -> dict[str, list[str]]:
    """{name: overrides} of `--variant NAME OVERRIDE...` as the CLI gives them ([[name, override, ...], ...]);
    a dict passes through, None gives {}."""
    if isinstance(variants, dict):
        return variants
    return {name: overrides for name, *overrides in variants or []}


def ablation(
    cfg: PeagleConfig,
    variants: Annotated[
        dict[str, list[str]] | list[list[str]] | None,
        Opt(
            "A variant: its name, then config overrides (repeatable; the first is the baseline), e.g. "
            "--variant base --variant frozen drafter.freeze_lm_head=true",
            variants=True,
        ),
    ] = None,
    steps: Annotated[int, Opt("Optimizer steps per variant (0: the untrained drafters).")] = 100,
    progress: Progress = print,
) -> dict:
    """One run per variant ({name: ["section.field=value", ...]}, or [[name, override, ...], ...] as the CLI
    gives them; values parsed as YAML), the first being the baseline; none: the config alone. Validation
    replays training.validation_records records (None: all)."""
    variants = named_variants(variants) or {"baseline": []}
    train, validation = split_records(cfg, cfg.training.validation_records)
    result: dict[str, Any] = {
        "steps": steps,
        "baseline": next(iter(variants)),
        "train_records": len(train),
        "validation_records": len(validation),
        "variants": {},
    }
    for name, overrides in variants.items():
        variant = with_values(with_overrides(cfg, overrides), {"training.max_steps": max(steps, 1)})
        (row,) = train_and_measure(variant, train, validation, [steps], progress=progress)
        result["variants"][name] = {"overrides": overrides, **row}
    baseline = result["variants"][result["baseline"]]["val_acceptance_length"]
    for row in result["variants"].values():
        row["val_al_gain_vs_baseline"] = round(row["val_acceptance_length"] - baseline, 4)
    return result


def learning_curve(
    cfg: PeagleConfig,
    budgets: Annotated[Sequence[int], Opt("Steps to measure at.")] = (50, 100, 200, 400),
    algorithms: Annotated[Sequence[str], Opt("Algorithms trained.", choices=("peagle", "eagle3"))] = (
        "peagle",
        "eagle3",
    ),
    work_dir: Path | None = None,
    progress: Progress = print,
    variants: Annotated[
        dict[str, list[str]] | list[list[str]] | None,
        Opt(
            "A recipe: its name, then config overrides (repeatable; replaces --algorithms), e.g. --variant today "
            "--variant target drafter.init_from_target=-1",
            variants=True,
        ),
    ] = None,
) -> dict:
    """Per algorithm (or per recipe in `variants`, {name: ["section.field=value", ...]}) one run to
    max(budgets), measured at each budget (validation, and eval.suite via vLLM); the plot and exports go to
    work_dir (default <training.storage_path>/bench/learning-curve)."""
    recipes = named_variants(variants) or {algorithm: [f"drafter.algorithm={algorithm}"] for algorithm in algorithms}
    budgets = sorted(set(budgets))
    work_dir = work_dir or bench_dir(cfg, "learning-curve")
    train, validation = split_records(cfg, cfg.training.validation_records)
    result: dict[str, Any] = {
        "budgets": budgets,
        "suite": cfg.eval.suite,
        "train_records": len(train),
        "validation_records": len(validation),
        "curves": {},
    }
    if variants:
        result["recipes"] = recipes
    for name, overrides in recipes.items():
        run_cfg = with_values(with_overrides(cfg, overrides), {"training.max_steps": max(*budgets, 1)})
        measure = suite_measure(run_cfg, work_dir / "exports" / name) if cfg.eval.suite != "validation" else None
        result["curves"][name] = train_and_measure(run_cfg, train, validation, budgets, measure, progress)
    from peagle_ray.plots import plot_curve

    result["plot"] = str(plot_curve(result, work_dir / "learning_curve.png"))
    return result


def log_to_mlflow(cfg: PeagleConfig, result: dict, work_dir: Path | None = None) -> dict[str, str]:
    """An ablation's variants (run `ablation-<name>`, step = steps) or a learning curve's algorithms (run
    `curve-<algorithm>`, step = training tokens, with the plot and the JSON) into MLflow, the JSON in work_dir
    (default <training.storage_path>/bench/ablation or learning-curve); {name: run id}."""
    from peagle_ray.tracking import log_rows, tracking_uri

    work_dir = work_dir or bench_dir(cfg, "ablation" if "variants" in result else "learning-curve")
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "result.json").write_text(json.dumps(result, indent=2))
    runs = {}
    with tracking_uri(cfg, mlflow_dir(cfg.training.storage_path)) as uri:
        if "variants" in result:
            for name, row in result["variants"].items():
                runs[name] = log_rows(
                    uri, cfg, f"ablation-{name}", [row], "steps", "ablation", [work_dir / "result.json"], work_dir
                )
        for algorithm, rows in result.get("curves", {}).items():
            runs[algorithm] = log_rows(
                uri,
                cfg,
                f"curve-{algorithm}",
                rows,
                "train_tokens",
                "curve",
                [Path(result["plot"]), work_dir / "result.json"],
                work_dir,
            )
    return runs
