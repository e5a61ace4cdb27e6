"""The main job: `peagle-ray demo` / `make demo`, a general drafter and then the loop a deployment runs, on one
machine.

    local Ray cluster + local MLflow server
    -> target (embedded SmolLM2, converted once)                      `peagle-ray target prepare`
    -> data.sources (demo: ShareGPT's recorded answers, no             `peagle-ray data capture --prepare`
       regeneration), captured offline through the Serve-hosted target
    -> a general P-EAGLE drafter trained in Ray Train, registered      `peagle-ray train`
    -> (demo.compare_eagle3: EAGLE-3 on the same data and budget,      `peagle-ray eval`
       both evaluated on the general validation split)
    -> the endpoint serving the general drafter with recording on;     `peagle-ray serve`
       demo.requests of demo.workload sent through it
    -> adapt: the recorded traffic captured, the drafter fine-tuned    `peagle-ray adapt`
       on it, judged against the general one on the held-out
       requests (and MT-Bench, for forgetting), promoted, swapped in
       and, beside the served drafter, suffix decoding and the hybrid (both in one engine) timed with the
       target alone; the endpoint rolls onto the fastest measurably faster decoder (else the target alone)
    -> one table (target alone, general, adapted, suffix decoding, hybrid on the held-out requests), the
       minutes of each stage, and the live endpoint, recording, serving the decoder its measurement chose.

Every stage is the same code its own command runs. The budget is the config's (configs/demo.yaml);
`--scale N` multiplies the general drafter's training steps. Ctrl-C stops the endpoint, Ray and MLflow.
Stages whose output already exists (target, prepared data, captured shards, finished training) are reused,
so rerunning an interrupted run resumes it; recorded traffic accumulates across runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from peagle_ray.config import ConfigError, PeagleConfig, with_values
from peagle_ray.layout import mlflow_dir

if TYPE_CHECKING:
    from peagle_ray.adapt import AdaptReport
    from peagle_ray.eval.metrics import SweepResult


@dataclass(frozen=True)
class DemoResult:
    """What the demo ran: the live endpoint's URL, the drafter it ends on, MLflow's URL, the adaptation's
    report, the results table, the minutes per stage, demo.json, and (demo.compare_eagle3) the evaluation."""

    endpoint: str
    served: Path
    mlflow: str
    adapt: AdaptReport
    table: str
    minutes: dict[str, float]
    json: Path
    eval: SweepResult | None = None


class Stages:
    """The demo's stages: a header printed as each starts, and the minutes each took (`table`)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.rows: list[tuple[str, float]] = []  # (name, start)
        self.ended: float | None = None

    def start(self, name: str, detail: str = "") -> None:
        now = time.monotonic()
        self.rows.append((name, now))
        header = f"{name}: {detail}" if detail else name
        print(f"\n[demo] === {header} ({(now - self.started) / 60:.1f} min in) ===", flush=True)

    def finish(self) -> None:
        self.ended = time.monotonic()

    def minutes(self) -> dict[str, float]:
        """{stage: minutes}, each stage lasting until the next one started (the last until finish)."""
        ends = [start for _, start in self.rows[1:]] + [self.ended or time.monotonic()]
        return {name: round((end - start) / 60, 2) for (name, start), end in zip(self.rows, ends, strict=True)}

    def table(self) -> str:
        minutes = self.minutes()
        lines = ["| Stage | Minutes |", "|---|---:|", *(f"| {name} | {m:.1f} |" for name, m in minutes.items())]
        return "\n".join([*lines, f"| total | {sum(minutes.values()):.1f} |"])


def run_demo(cfg: PeagleConfig, scale: float = 1.0, wait: bool = True) -> DemoResult:
    """`peagle-ray demo`: run the main job on the embedded default target, end to end.

    Starts a local Ray cluster and MLflow server, prepares the target and data.sources, trains a general
    P-EAGLE drafter on their capture and registers it, serves it with recording on and sends demo.requests of
    demo.workload through the endpoint, adapts the drafter to that recording (`adapt`: judged against the
    general one on the held-out requests and adapt.general_suite, promoted and swapped in when it gains),
    prints one table and the minutes of each stage, and serves until Ctrl-C - drafting only where its
    held-out measurement was faster than the target alone. demo.compare_eagle3 adds the EAGLE-3 baseline on
    the same data and budget. Rerunning resumes. `make demo` uses configs/demo.yaml; configs/cpu-full.yaml
    is the best CPU recipe.

    Without `wait` (--no-wait) it stops everything after printing the results; with it, Ctrl-C (or SIGTERM /
    SIGHUP through the CLI) stops everything and raises KeyboardInterrupt. The same run step by step:
    demo_steps."""
    steps = demo_steps(cfg, scale)
    try:
        result = next(step.result for step in steps if step.result is not None)
        if wait:
            print("[demo] the endpoint is live; Ctrl-C stops it (and Ray and MLflow)", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                print("\n[demo] stopping: the endpoint, Ray and MLflow", flush=True)
                raise  # after the cleanup below; the CLI exits 128 + the signal
        return result
    finally:
        steps.close()  # the endpoint, Ray and MLflow stopped


@dataclass(frozen=True)
class DemoStep:
    """Where demo_steps has paused: "data" (MLflow up, nothing registered yet), "adapt" (the endpoint up at
    `url`, the workload recorded, adapt not started) or "ready" (the results printed, the endpoint live:
    `result`); `cfg` is the run's config (its tracking URI, record directory)."""

    name: str
    cfg: PeagleConfig
    url: str | None = None
    result: DemoResult | None = None


def demo_steps(cfg: PeagleConfig, scale: float = 1.0) -> Generator[DemoStep, None, None]:
    """run_demo's run, paused before the data stage, as the adapt stage starts and once the results are
    printed (DemoStep): a caller sends its own traffic or checks there, stage by stage. Everything it started
    (the endpoint, Ray, MLflow) stops when it is run to its end or closed."""
    import ray
    from ray import serve

    from peagle_ray.adapt import run_adapt
    from peagle_ray.cluster import ensure_ray, joined_cluster
    from peagle_ray.export.speculators import read_drafter
    from peagle_ray.serve.app import endpoint_banner, served_model, serving_decoder, stop_endpoint
    from peagle_ray.target import resolve_target_path
    from peagle_ray.tracking import tracking_uri

    stages = Stages()
    cfg = _with_target(cfg, scale, stages)
    ensure_ray()
    storage = Path(cfg.training.storage_path)
    print(
        f"[demo] logs: {Path(cfg.serving.log_dir).resolve()} (vLLM engines), /tmp/ray/session_latest/logs (Ray; "
        "Ray Data's progress in ray-data/ray-data.log)",
        flush=True,
    )
    with tracking_uri(cfg, mlflow_dir(storage)) as uri:
        record_dir = cfg.serving.record_dir or str(storage / "traffic")
        cfg = with_values(cfg, {"tracking.tracking_uri": uri, "serving.record_dir": record_dir, "adapt.swap": True})
        print(f"[demo] MLflow UI: {uri}")
        try:
            yield DemoStep("data", cfg)
            general, version = _general_drafter(cfg, stages)
            evaluated = _compare_eagle3(cfg, general, stages) if cfg.demo.compare_eagle3 else None
            label = f"{cfg.tracking.registered_model}/{version}"
            url = _workload_traffic(cfg, general, label, stages)
            stages.start("adapt", f"the general drafter fine-tuned on the recorded {cfg.demo.workload} traffic")
            yield DemoStep("adapt", cfg, url)
            report = run_adapt(cfg)
            served, served_label = (Path(report.served_dir), f"{cfg.tracking.registered_model}/{report.served_version}")
            if not report.swapped:  # adapt left the endpoint as it was: serving the general drafter
                served, served_label = general, label
            serving = serving_decoder(with_values(cfg, {"serving.drafter_version": served_label}), read_drafter(served))
            stages.finish()
            table = results_table(report)
            result = storage / "demo.json"
            result.write_text(
                json.dumps(
                    {
                        "minutes": stages.minutes(),
                        "table": table,
                        "served": serving.to_json(),
                        "adapt": report.to_json(),
                    },
                    indent=2,
                )
            )
            print(
                f"\n{table}\n\n{stages.table()}\n\nresults: {result} and {report.json}\nMLflow UI: {uri}\n"
                f"{endpoint_banner(url, cfg, served_model(resolve_target_path(cfg)))}\n"
                f"{serving.line()} (recording to {record_dir})\n"
                f"[demo] done in {sum(stages.minutes().values()):.1f} min",
                flush=True,
            )
            yield DemoStep(
                "ready", cfg, url, DemoResult(url, served, uri, report, table, stages.minutes(), result, evaluated)
            )
        except KeyboardInterrupt:
            print("\n[demo] stopping: the endpoint, Ray and MLflow", flush=True)
            raise  # after the cleanup below; the CLI exits 128 + the signal
        finally:
            try:
                stop_endpoint()
                if joined_cluster():  # a cluster we joined keeps running: leave it without our Serve instance
                    serve.shutdown()
            finally:
                # a local cluster goes with everything on it; serve.shutdown() there only made Ray print the
                # controller's own graceful_shutdown task as "killed by ray.kill" on the console
                ray.shutdown()


def _with_target(cfg: PeagleConfig, scale: float, stages: Stages) -> PeagleConfig:
    """The config with the target prepared (the embedded one converted once), the steps scaled, storage absolute."""
    from peagle_ray.target import drafter_target, prepare_embedded_target

    stages.start("target")
    target = Path(cfg.target.path) if cfg.target.path else prepare_embedded_target(cfg.cache_path())
    steps = max(1, round(cfg.training.max_steps * scale))
    storage = Path(cfg.training.storage_path).resolve()
    cfg = with_values(
        cfg, {"target.path": str(target), "training.max_steps": steps, "training.storage_path": str(storage)}
    )
    drafter_target(cfg)  # its rope and aux layers, before any stage starts an engine
    print(f"[demo] target {target}; the general drafter trains {steps} steps")
    return cfg


def _general_drafter(cfg: PeagleConfig, stages: Stages) -> tuple[Path, str]:
    """Prepared data (reused when present), its capture (resumed), then the general P-EAGLE drafter trained
    and registered; (export directory, registered version)."""
    from peagle_ray.capture.run import prepare_and_capture, samples_to_capture
    from peagle_ray.data.prepare import PreparedData
    from peagle_ray.layout import run_name_for
    from peagle_ray.train.job import run_training

    regenerated = ", responses regenerated by the target" if cfg.data.regenerate else ", their recorded answers"
    stages.start("data", f"{', '.join(cfg.data.sources)}{regenerated}; {cfg.capture.mode} capture")
    prepare = not PreparedData.exists(cfg.data.output_dir)
    if not prepare:
        print(f"[demo] reusing prepared data in {cfg.data.output_dir}")
    # offline capture writes hidden states once (resumed where a previous run stopped)
    capture = cfg.capture.mode == "offline" and (prepare or bool(samples_to_capture(cfg)[0]))
    if prepare or capture:
        prepare_and_capture(cfg, prepare=prepare, capture=capture)
    stages.start("general drafter", f"P-EAGLE, {cfg.training.max_steps} steps in Ray Train")
    general = with_values(cfg, {"drafter.algorithm": "peagle"})
    trained = run_training(with_values(general, {"training.run_name": run_name_for(general, "peagle")}))
    if trained.registered_version is None:  # the loop swaps registered versions in and out
        raise ConfigError("the demo registers its drafters: tracking.registered_model must name a model (got null)")
    return Path(trained.export_dir), trained.registered_version


def _compare_eagle3(cfg: PeagleConfig, general: Path, stages: Stages) -> SweepResult:
    """EAGLE-3 on the same data and budget, and both evaluated on the general validation split (eval.*)."""
    from peagle_ray.eval.sweep import evaluate
    from peagle_ray.layout import run_name_for
    from peagle_ray.train.job import run_training

    stages.start("EAGLE-3 (demo.compare_eagle3)", "the same data and budget")
    run_cfg = with_values(
        cfg,
        {
            "drafter.algorithm": "eagle3",
            "training.run_name": run_name_for(cfg, "eagle3"),
            "tracking.registered_model": None,  # a comparison, not a version the endpoint could serve
        },
    )
    eagle3 = Path(run_training(run_cfg).export_dir)
    stages.start("evaluate", f"target alone, P-EAGLE and EAGLE-3 at K = {cfg.eval.k_values}")
    evaluated = evaluate(cfg, {"peagle": general, "eagle3": eagle3})
    print(f"\n{evaluated.table}\n", flush=True)
    return evaluated.results


def _workload_traffic(cfg: PeagleConfig, general: Path, label: str, stages: Stages) -> str:
    """The endpoint serving the general drafter (as the registry's `label`) with recording on, and
    demo.requests of demo.workload sent through it one at a time; the endpoint's URL (it stays up)."""
    from tqdm import tqdm

    from peagle_ray.adapt import served_tags
    from peagle_ray.data.workload import workload_prompts
    from peagle_ray.export.speculators import read_drafter
    from peagle_ray.serve.app import serving_decoder, start_endpoint
    from peagle_ray.serve.client import send_traffic
    from peagle_ray.target import resolve_target_path
    from peagle_ray.tracking import set_model_tags

    prompts = workload_prompts(cfg.demo.workload)[: cfg.demo.requests]
    stages.start("workload", f"{len(prompts)} {cfg.demo.workload} requests through the endpoint, recorded")
    target = resolve_target_path(cfg)
    versioned = with_values(cfg, {"serving.drafter_version": label})
    url = start_endpoint(versioned, target, read_drafter(general))
    served = serving_decoder(versioned, read_drafter(general))
    uri, registered = cfg.tracking.tracking_uri, cfg.tracking.registered_model
    assert uri is not None and registered is not None  # run_demo set the one, _general_drafter checked the other
    set_model_tags(uri, registered, served_tags(served))
    print(
        f"[demo] the endpoint serves {served.describe()} ({label}) at {url}, recording to {cfg.serving.record_dir}",
        flush=True,
    )
    with tqdm(total=len(prompts), desc="workload", unit="request") as bar:
        sent = send_traffic(cfg, url, target.name, prompts, cfg.demo.max_tokens, progress=bar)
    print(f"[demo] {sent.requests} requests in {sent.seconds:.0f} s ({sent.failed} failed)", flush=True)
    return url


def results_table(report: AdaptReport) -> str:
    """The held-out requests' table, every speedup against one baseline: the target alone, the served drafter,
    suffix decoding and the hybrid from adapt's one decoder comparison (report.decoders), the other drafter
    with its acceptance only (judged for promotion, not timed beside that baseline); the general suite's AL
    beside the drafters (forgetting); and what is served."""
    measured, k, session = report.measured, report.k, report.decoders
    served_who = "new" if report.promote else "parent"
    target = session.get("target") or {"tokens_per_s": measured["parent"].heldout["baseline_tokens_per_s"]}
    head = [
        f"Held-out {report.samples.get('validation', 0)} recorded requests, greedy, batch 1, K = {k}; "
        "every speedup against the target alone of the same comparison",
        "",
        "| Decoder | AL | Acceptance per position | Tokens/s | Speedup | Mismatches | General-suite AL |",
        "|---|---:|---|---:|---:|---:|---:|",
        f"| target alone | 1.00 | - | {target['tokens_per_s']:.1f} | 1.00x | - | 1.00 |",
    ]
    rows = []
    for who, name in (("parent", f"general (v{report.parent_version})"), ("new", f"adapted (v{report.version})")):
        general = f"{measured[who].general['acceptance_length']:.2f}"
        if "target" not in session:  # no decoder comparison ran: both drafters timed beside judge's baseline
            rows.append(table_row(name, measured[who].heldout, general))
        elif who == served_who:
            rows.append(table_row(name, session["drafter"], general))
        else:
            rows.append(table_row(name, measured[who].heldout, general, timed=False))
    served_as = "adapted" if report.promote else "general"
    for decoder, name in (("suffix", "suffix decoding"), ("hybrid", f"hybrid ({served_as} + suffix)")):
        row = session.get(decoder)
        if row is not None:
            rows.append(f"| {name} | failed: {row['failed']} |" if "failed" in row else table_row(name, row, "-"))
    verdict = f"adapted: {report.verdict.why}; promoted: {report.promote}"
    return "\n".join([*head, *rows, "", verdict, f"served: {report.recommendation}"])


def table_row(name: str, row: Mapping, general_al: str, timed: bool = True) -> str:
    """One row; `timed` False: acceptance only (a drafter not timed beside this table's baseline)."""
    spread = f" +- {row['speedup_se']:.2f}" if row.get("speedup_se") else ""
    positions = " ".join(f"{p:.2f}" for p in row["acceptance_per_position"])
    speed = f"{row['tokens_per_s']:.1f} | {row['speedup'] or 0:.2f}x{spread}" if timed else "- | - (AL judged only)"
    return (
        f"| {name} | {row['acceptance_length']:.2f} | {positions} | {speed} | {row['greedy_mismatches']} | "
        f"{general_al} |"
    )
