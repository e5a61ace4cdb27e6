"""`peagle-ray bench adapt`: does adapting the served drafter to a workload pay, against what a user would
pick instead? One run per workload, every figure from one machine and one run.

For each workload:
  1. split the workload's prompts by prompt id (train / held-out; held-out prompts never reach the endpoint);
  2. serve the un-adapted drafter (registered as version 1 in the bench's own MLflow store) with recording
     on, and send the train split as an OpenAI client would: batch 1, the endpoint's default sampling;
  3. `adapt` on that recording (adapt.max_steps, validation every training.validate_every steps: the curve
     of offline held-out AL against adaptation minutes comes from those validations' MLflow timestamps);
  4. measure the held-out split with stock vLLM at the served K, greedy, batch 1 timing: the target alone,
     the un-adapted and the adapted drafter, vLLM's n-gram drafter (prompt lookup, no training) and suffix
     decoding (`method: suffix`, training-free; its response cache is fed the train split first; its suffix
     tree is built into the virtualenv by `make setup`).

Workloads: data/workload.py (each a real task family, not a benchmark's mix).

Goals (bench/goals.py ADAPT; ratios within the run): held-out AL, speedup over the target alone and over the
un-adapted drafter, ahead of suffix decoding; the most general-suite AL lost against the un-adapted drafter
(adapt's own judge); 0 greedy mismatches.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from peagle_ray.bench.goals import ADAPT
from peagle_ray.config import ConfigError, PeagleConfig, with_values
from peagle_ray.layout import VAL_ACCEPTANCE_LENGTH, bench_dir, mlflow_dir
from peagle_ray.options import Opt

if TYPE_CHECKING:
    from peagle_ray.adapt import AdaptReport
    from peagle_ray.serve.client import Sent


def run(
    cfg: PeagleConfig,
    drafters: dict[str, Path],
    workloads: Annotated[tuple[str, ...], Opt("humaneval, sharegpt-WORD (e.g. sharegpt-email), builtin-CATEGORY.")] = (
        "humaneval",
        "sharegpt-email",
    ),
    train_prompts: Annotated[int, Opt("Train-split prompts sent to the endpoint.")] = 96,
    heldout_prompts: Annotated[int, Opt("Held-out prompts measured.")] = 24,
    max_tokens: Annotated[int, Opt("Tokens per request (recording and measurement).")] = 128,
    steps: Annotated[int, Opt("Adaptation steps (adapt.max_steps).")] = 200,
    progress=print,
) -> dict:
    """{"workloads": {name: result}, "goals": {name: {...}}} (module docstring)."""
    if "peagle" not in drafters:
        raise ConfigError("bench adapt starts from a P-EAGLE drafter: pass --peagle DIR or train one first")
    out: dict[str, Any] = {
        "drafter": str(drafters["peagle"]),
        "max_tokens": max_tokens,
        "steps": steps,
        "workloads": {},
    }
    for name in workloads:
        progress(f"[bench adapt] {name}")
        out["workloads"][name] = workload_run(
            cfg, drafters["peagle"], name, train_prompts, heldout_prompts, max_tokens, steps, progress
        )
    out["goals"] = {name: goals(r) for name, r in out["workloads"].items()}
    return out


def workload_run(cfg, base: Path, name, train_count, heldout_count, max_tokens, steps, progress) -> dict:
    from peagle_ray.adapt import run_adapt
    from peagle_ray.cluster import ensure_ray
    from peagle_ray.data.workload import split_prompts, workload_prompts
    from peagle_ray.serve.app import free_port
    from peagle_ray.tracking import metric_times, register_export

    train, heldout = split_prompts(workload_prompts(name), 0.3, train_count, heldout_count)
    work = bench_dir(cfg, "adapt") / name
    shutil.rmtree(work, ignore_errors=True)  # the bench's own store: every run starts from version 1
    uri = f"sqlite:///{(work / 'mlflow.db').resolve()}"
    work.mkdir(parents=True)
    wcfg = with_values(
        cfg,
        {
            "serving.record_dir": str(work / "traffic"),
            "serving.port": free_port(),
            "training.storage_path": str(work / "train"),
            "tracking.tracking_uri": uri,
            "adapt.max_steps": steps,
            "adapt.swap": False,
            "adapt.min_requests": 1,
            "eval.max_new_tokens": max_tokens,
        },
    )
    register_export(uri, wcfg, "unadapted", base, work / "mlflow")
    ensure_ray()
    recorded = record_traffic(wcfg, base, train, max_tokens)
    progress(f"[bench adapt] {name}: {recorded.requests} requests recorded in {recorded.seconds:.0f} s")
    started = time.monotonic()
    report = run_adapt(wcfg)
    minutes = (time.monotonic() - started) / 60
    curve = [
        {"step": step, "minutes": round(seconds / 60, 2), "acceptance_length": round(al, 4)}
        for step, al, seconds in metric_times(uri, report.run_id, VAL_ACCEPTANCE_LENGTH)
    ]
    measured = measure(wcfg, report, base, train, heldout)
    return {
        "train_prompts": len(train),
        "heldout_prompts": len(heldout),
        "recording": asdict(recorded),
        "adaptation_minutes": round(minutes, 2),
        "adapt": {"version": report.version, "k": report.k, "samples": report.samples, **asdict(report.verdict)},
        "general": {who: report.measured[who].general for who in ("parent", "new")},
        "curve": curve,
        "heldout": measured,
    }


def record_traffic(cfg: PeagleConfig, base: Path, prompts: list, max_tokens: int) -> Sent:
    """The train split through the recording endpoint (serving `base` as the registry's version 1), then the
    endpoint stopped; send_traffic's figures."""
    from peagle_ray.export.speculators import read_drafter
    from peagle_ray.serve.app import start_endpoint, stop_endpoint
    from peagle_ray.serve.client import send_traffic
    from peagle_ray.target import resolve_target_path

    target = resolve_target_path(cfg)
    versioned = with_values(cfg, {"serving.drafter_version": f"{cfg.tracking.registered_model}/1"})
    url = start_endpoint(versioned, target, read_drafter(base))
    try:
        return send_traffic(cfg, url, target.name, prompts, max_tokens)
    finally:
        stop_endpoint()


def measure(cfg: PeagleConfig, report: AdaptReport, base: Path, train: list, heldout: list) -> dict:
    """Held-out rows (eval's "overall" shape) per decoder, all at the served K, in one run (eval.compare)."""
    from transformers import AutoTokenizer

    from peagle_ray.data.prepare import render
    from peagle_ray.eval import compare
    from peagle_ray.target import resolve_target_path

    target = resolve_target_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = lambda ps: [render(tokenizer, p.messages, add_generation_prompt=True) for p in ps]  # noqa: E731
    k = report.k
    candidates = [
        compare.drafter("unadapted", base, k),
        compare.drafter("adapted", Path(report.export_dir), k),
        compare.ngram(k),
        compare.suffix(k, warmup=ids(train)),  # its response cache fed the train split first
    ]
    rows = compare.compare(cfg, target, candidates, {"heldout": ids(heldout)}, cfg.eval.timing_prompts).overall()
    unadapted = rows["unadapted"]["tokens_per_s"]
    rows["adapted"]["speedup_vs_unadapted"] = (
        round(rows["adapted"]["tokens_per_s"] / unadapted, 3) if unadapted else None
    )
    return rows


def goals(result: dict) -> dict:
    """Each goal with the measured value and whether it is met (None where a comparison was not run)."""
    rows = result["heldout"]
    adapted = rows["adapted"]
    suffix = rows.get("suffix", {})
    drop = result["general"]["parent"]["acceptance_length"] - result["general"]["new"]["acceptance_length"]
    checks = {
        "acceptance_length": (adapted["acceptance_length"], adapted["acceptance_length"] >= ADAPT["acceptance_length"]),
        "speedup_vs_target": (adapted["speedup"], (adapted["speedup"] or 0) >= ADAPT["speedup"]),
        "speedup_vs_unadapted": (
            adapted["speedup_vs_unadapted"],
            (adapted["speedup_vs_unadapted"] or 0) >= ADAPT["vs_unadapted"],
        ),
        "ahead_of_suffix": (
            suffix.get("tokens_per_s"),
            adapted["tokens_per_s"] > suffix["tokens_per_s"] if "tokens_per_s" in suffix else None,
        ),
        "general_al_drop": (round(drop, 4), drop <= ADAPT["general_drop"]),
        "greedy_mismatches": (adapted["greedy_mismatches"], adapted["greedy_mismatches"] == 0),
    }
    return {name: {"measured": value, "met": met} for name, (value, met) in checks.items()}


def log_to_mlflow(cfg: PeagleConfig, result: dict) -> dict[str, str]:
    """One run `bench-adapt-<workload>` per workload: the curve (bench-adapt/curve_* at step = training step),
    the held-out rows (bench-adapt/<decoder>_<field>) and result.json; {workload: run id}."""
    import json

    from peagle_ray.tracking import log_rows, tracking_uri

    work = bench_dir(cfg, "adapt")
    work.mkdir(parents=True, exist_ok=True)
    (work / "result.json").write_text(json.dumps(result, indent=2))
    runs = {}
    with tracking_uri(cfg, mlflow_dir(cfg.training.storage_path)) as uri:
        for name, r in result["workloads"].items():
            flat: dict[str, Any] = {"step": 0}
            for decoder, row in r["heldout"].items():
                flat.update({f"{decoder}_{k}": v for k, v in row.items() if isinstance(v, (int, float, list))})
            run = f"bench-adapt-{name}"
            curve = [{"curve_" + k: v for k, v in point.items()} | {"step": point["step"]} for point in r["curve"]]
            log_rows(uri, cfg, run, curve, "step", "bench-adapt", [], work)
            runs[name] = log_rows(uri, cfg, run, [flat], "step", "bench-adapt", [work / "result.json"], work)
    return runs
