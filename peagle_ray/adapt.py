"""`peagle-ray adapt`: the served drafter learns the endpoint's recorded traffic; a better version is promoted
and swapped into the running endpoint.

    recorded traffic (serving.record_dir)
      -> data: traffic:DIR, split by request (adapt.validation_fraction held out), no regeneration
      -> parent: the registered version holding adapt.alias ("serving"), downloaded from MLflow
      -> capture: the traffic's hidden states, once, through the Serve-hosted target (offline shards: a
         small recording is trained on for many epochs, and streaming would capture it again each epoch)
      -> train: training.init_from = parent (its draft vocabulary kept), adapt.max_steps; registered as a
         new version (tags: parent, measurements)
      -> judge: stock vLLM, target alone / parent / new at the served K, on the held-out traffic and on
         adapt.general_suite (forgetting)
      -> promote when held-out AL gains >= adapt.min_gain and the suite's AL loses <= adapt.max_regression:
         the alias moves
      -> the decoder to serve: the served drafter (the new one when promoted), suffix decoding and the
         hybrid (adapt.decoders), timed side by side with the target alone on the held-out traffic; the
         fastest measurably faster one, else the target alone (recommendation.json, which serving reads)
      -> with adapt.swap, the endpoint on this cluster rolls onto it when that changes what it serves; the
         registered model's tags say what is served (served.decoder, served.k, served.version, served.why)

e.g. held-out AL parent 1.20 -> new 1.65 (gain 0.45 >= 0.05), MT-Bench 1.18 -> 1.17 (loss 0.01 <= 0.02):
promoted. Everything lands in <storage>/adapt/<time>/adapt.json and the adaptation's MLflow run.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from peagle_ray import layout
from peagle_ray.config import ConfigError, PeagleConfig, with_values
from peagle_ray.data.traffic import (
    CATEGORY as TRAFFIC,
    PREFIX as TRAFFIC_IDS,
    traffic_dir,
    window_requests,
    window_source,
)

if TYPE_CHECKING:
    from peagle_ray.eval.metrics import Row
    from peagle_ray.serve.registry import ServedExport


@dataclass(frozen=True)
class Judged:
    """One drafter version as judge measured it at the served K: its overall row on the held-out traffic and
    on adapt.general_suite, and the suite's AL per category (for the spread of a loss)."""

    heldout: Row
    general: Row
    general_by_category: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"heldout": self.heldout, "general": {**self.general, "by_category": self.general_by_category}}


@dataclass(frozen=True)
class Verdict:
    """Promote or not (decide): the held-out AL gain, the general suite's AL loss, and why."""

    gain: float
    regression: float
    promote: bool
    why: str


@dataclass
class AdaptReport:
    """One adaptation (adapt.json is its to_json()): the versions, the K served, the samples trained and held
    out, each version judged, the verdict, whether the new version drafts when served (and why), where it is."""

    registered_model: str
    parent_version: str
    version: str | None  # None: not registered
    k: int
    samples: dict[str, int]  # {"train", "validation"}: recorded requests
    train_steps: int
    measured: dict[str, Judged]  # "parent", "new"
    verdict: Verdict
    decoder: str  # what is served: "target" | "drafter" | "suffix" | "hybrid", and why: recommendation
    recommendation: str
    export_dir: str
    run_id: str
    served_dir: str = ""  # the export deployed (the new one when promoted, else the parent's)
    served_version: str = ""
    decoders: dict[str, dict] = field(default_factory=dict)  # each decoder's held-out row (or {"failed": why})
    swapped: bool = False
    json: str = ""  # adapt.json

    @property
    def promote(self) -> bool:
        return self.verdict.promote

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("measured", "verdict", "swapped", "json")}
        out["measured"] = {who: judged.to_json() for who, judged in self.measured.items()}
        out.update(asdict(self.verdict), swapped=self.swapped)
        return out


def registered_name(cfg: PeagleConfig) -> str:
    """tracking.registered_model, which adaptation needs (it starts from a registered version)."""
    if not cfg.tracking.registered_model:
        raise ConfigError("adapt starts from a registered drafter: tracking.registered_model must be set; got None")
    return cfg.tracking.registered_model


def traffic_source(cfg: PeagleConfig) -> str:
    """traffic:DIR for adapt.traffic_dir, else serving.record_dir; refused when neither is set."""
    directory = cfg.adapt.traffic_dir or cfg.serving.record_dir
    if directory is None:
        raise ConfigError(
            "adapt needs recorded traffic: set serving.record_dir (where the endpoint records) or "
            "adapt.traffic_dir; got neither"
        )
    return window_source(Path(directory).resolve())


TRAFFIC_UNTIL = "adapt.traffic_until"  # the registered model's tag: the newest request the last adaptation read


def new_traffic(cfg: PeagleConfig, uri: str, name: str) -> tuple[str, float]:
    """(the traffic source of this adaptation, the newest request's time in it): the requests recorded after
    adapt.since, else after the last adaptation's (TRAFFIC_UNTIL), up to now. Refused (ConfigError, which
    continuous mode reports as a skipped round) with fewer than adapt.min_requests of them."""
    from peagle_ray.tracking import model_tags

    directory = traffic_dir(traffic_source(cfg))
    since, why = cfg.adapt.since, "adapt.since"
    if since is None and (last := model_tags(uri, name).get(TRAFFIC_UNTIL)):
        since, why = float(last), "the newest request the last adaptation read; adapt.since overrides it"
    count, newest = window_requests(window_source(directory, since))
    if count < cfg.adapt.min_requests or newest is None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
        after = f" after {when} ({why})" if since else ""
        raise ConfigError(
            f"too little new traffic in {directory}: {count} requests recorded{after}; "
            f"adapt.min_requests is {cfg.adapt.min_requests}"
        )
    return window_source(directory, since, newest), newest


def adapt_config(cfg: PeagleConfig, source: str, work: Path, parent_dir: Path, uri: str) -> PeagleConfig:
    """The training config of one adaptation: the traffic as data, the parent as the starting point."""
    return with_values(
        cfg,
        {
            "data.sources": [source, *cfg.adapt.replay],
            "data.regenerate": False,  # the recorded outputs are the target's own
            "data.validation_fraction": cfg.adapt.validation_fraction,
            "data.output_dir": str(work / "data"),
            "capture.mode": "offline",
            "capture.output_dir": str(work / "hidden"),
            "training.init_from": str(parent_dir),
            "training.max_steps": cfg.adapt.max_steps,
            "training.validation_prefix": TRAFFIC_IDS,  # the curve is the workload's, not the replay's
            "training.run_name": f"{cfg.training.run_name}-adapt-{work.name}",
            "tracking.tracking_uri": uri,
        },
    )


def epochs_for(cfg: PeagleConfig, train_records: int) -> int:
    """The passes over `train_records` that adapt.max_steps steps take (a recording smaller than the budget is
    repeated): each of training.num_workers workers (the most, for an elastic [min, max]) reads its share,
    the smallest being records // workers, and each step takes training.sequences_per_step of it.

    e.g. 120 steps x 4 sequences over 18 records on 1 worker -> 27 passes; 10 x 2 over 7 on 2 (shares of
    3 and 4) -> 7."""
    workers = cfg.training.num_workers
    share = max(1, train_records // (max(workers) if isinstance(workers, list) else workers))
    return max(1, math.ceil(cfg.adapt.max_steps * cfg.training.sequences_per_step / share))


def decide(cfg: PeagleConfig, parent: Judged, child: Judged) -> Verdict:
    """Promote or not, from each version's judged rows. The held-out AL gain must reach adapt.min_gain and be
    measurable: beyond two standard errors of the per-request gains (gain_error: each held-out request timed by
    both versions, paired). The general suite's loss counts as forgetting only where it is measurable: less
    two standard errors of the per-category differences (regression_error; the loss itself without them)
    above adapt.max_regression.

    e.g. heldout AL 1.20 -> 1.65 (+0.45 +- 0.05 over the requests) and general 1.18 -> 1.17 with min_gain
    0.05, max_regression 0.02 -> Verdict(gain=0.45, regression=0.01, promote=True, why="...")."""
    gain = child.heldout["acceptance_length"] - parent.heldout["acceptance_length"]
    gain_se = gain_error(parent, child)
    regression = parent.general["acceptance_length"] - child.general["acceptance_length"]
    se = regression_error(parent, child)
    mismatches = child.heldout["greedy_mismatches"] + child.general["greedy_mismatches"]
    reasons = []
    if gain < cfg.adapt.min_gain:
        reasons.append(f"held-out AL gain {gain:+.3f} < adapt.min_gain {cfg.adapt.min_gain}")
    elif gain_se is not None and gain <= 2 * gain_se:
        reasons.append(f"held-out AL gain {gain:+.3f} is within 2 standard errors (+- {gain_se:.3f}) of zero")
    if regression - 2 * (se or 0.0) > cfg.adapt.max_regression:
        spread = f" (+- {se:.3f} over its categories)" if se is not None else ""
        reasons.append(
            f"{cfg.adapt.general_suite} AL loss {regression:.3f}{spread} > adapt.max_regression "
            f"{cfg.adapt.max_regression}"
        )
    if mismatches and cfg.target.dtype == "float32":
        reasons.append(f"{mismatches} greedy outputs differ from the target's (float32 must be lossless)")
    bar = f" +- {gain_se:.3f}" if gain_se is not None else " (no error bar: under 2 held-out requests timed)"
    return Verdict(
        round(gain, 4),
        round(regression, 4),
        not reasons,
        "; ".join(reasons) or f"held-out gain {gain:+.3f}{bar} and general-suite loss within bounds",
    )


def gain_error(parent: Judged, child: Judged) -> float | None:
    """The standard error of the held-out AL gain, from the paired per-request gains (each held-out request's AL
    under the new version less under the served one, over the requests both timed); None under 2.

    e.g. per-request ALs [1.0, 1.5, 1.2] -> [1.4, 1.5, 1.6]: gains [0.4, 0.0, 0.4] -> 0.133."""
    from peagle_ray.eval.metrics import standard_error

    before = parent.heldout.get("prompt_acceptance_lengths") or []
    after = child.heldout.get("prompt_acceptance_lengths") or []
    return standard_error([b - a for a, b in zip(before, after, strict=False)])


def regression_error(parent: Judged, child: Judged) -> float | None:
    """The standard error of the general suite's AL loss, from the paired per-category losses (as judge
    records them); None without per-category figures for at least 2 categories.

    e.g. by category {"a": 1.2, "b": 1.3} -> {"a": 1.1, "b": 1.3}: losses [0.1, 0.0] -> 0.05."""
    from peagle_ray.eval.metrics import standard_error

    before, after = parent.general_by_category, child.general_by_category
    return standard_error([before[c] - after[c] for c in sorted(before) if c in after])


def judge(cfg: PeagleConfig, acfg: PeagleConfig, drafters: dict[str, Path], k: int) -> dict[str, Judged]:
    """Each drafter judged against the target alone (eval.compare) over the held-out traffic and the general
    suite together: stock vLLM, the served K, one engine per decoder."""
    from peagle_ray.eval import compare
    from peagle_ray.eval.sweep import eval_prompts
    from peagle_ray.target import resolve_target_path

    target = resolve_target_path(cfg)
    heldout = eval_prompts(with_values(acfg, {"eval.suite": "validation", "eval.prompts_per_category": 10**6}), target)
    suite = eval_prompts(with_values(cfg, {"eval.suite": cfg.adapt.general_suite}), target)
    prompts = {TRAFFIC: heldout.get(TRAFFIC, []), **{f"general/{c}": p for c, p in suite.items()}}
    print(f"[adapt] judging on {len(prompts[TRAFFIC])} held-out requests and {cfg.adapt.general_suite}", flush=True)
    candidates = [compare.drafter(name, directory, k) for name, directory in drafters.items()]
    progress = lambda what: print(f"[adapt] judging: {what}", flush=True)  # noqa: E731
    judged = compare.compare(cfg, target, candidates, prompts, cfg.eval.timing_prompts, progress)
    out = {}
    for name in drafters:
        general = judged.rows(name, lambda c: c != TRAFFIC)
        out[name] = Judged(
            heldout=judged.rows(name, lambda c: c == TRAFFIC)["overall"],
            general=general["overall"],
            general_by_category={c: row["acceptance_length"] for c, row in general.items() if c != "overall"},
        )
    return out


def choose_decoder(cfg: PeagleConfig, acfg: PeagleConfig, export_dir: Path, k: int, drafter_row: Row):
    """(Recommendation, {decoder: held-out row, "target": the baseline's row}): the served drafter, suffix
    decoding and the hybrid of this drafter (adapt.decoders) timed in one comparison, side by side with one
    target-alone engine on the held-out traffic, after generating the recent recorded training requests
    (adapt.warmup_requests: what a serving endpoint's suffix cache holds); eval.metrics.pick_decoder's verdict,
    every row against the same baseline. With no other decoder to weigh, the drafter's held-out row from
    judge (`drafter_row`) decides alone. The hybrid on a vLLM release it was not written for is a note."""
    from peagle_ray.eval import compare
    from peagle_ray.eval.metrics import pick_decoder
    from peagle_ray.hybrid import unsupported
    from peagle_ray.target import resolve_target_path

    rows: dict[str, dict] = {"drafter": dict(drafter_row)}
    warmup = traffic_prompts(acfg, "train")[-cfg.adapt.warmup_requests :] if cfg.adapt.warmup_requests else []
    peers = []
    if "suffix" in cfg.adapt.decoders:
        peers.append(compare.suffix(k, warmup))
    if "hybrid" in cfg.adapt.decoders:
        if (problem := unsupported()) is None:
            peers.append(compare.hybrid("hybrid", export_dir, k, cfg.serving.hybrid_threshold, warmup))
        else:
            rows["hybrid"] = {"failed": problem}
    if peers:
        heldout = traffic_prompts(acfg, "validation")
        progress = lambda what: print(f"[adapt] decoders: {what}", flush=True)  # noqa: E731
        candidates = [compare.drafter("drafter", export_dir, k), *peers]
        judged = compare.compare(
            cfg, resolve_target_path(cfg), candidates, {TRAFFIC: heldout}, cfg.eval.timing_prompts, progress
        )
        if len(candidates) >= cfg.eval.engines_at_once:  # compare's groups, one target-alone engine each
            print(
                f"[adapt] decoders: eval.engines_at_once {cfg.eval.engines_at_once} timed them in groups, each "
                "beside its own target-alone engine: compare their speedups, not their tokens/s",
                flush=True,
            )
        rows.update(judged.overall())
    return pick_decoder(rows, k, exact=cfg.target.dtype == "float32"), rows


def traffic_prompts(acfg: PeagleConfig, split: str) -> list[list[int]]:
    """The prompt part of each recorded request in a split of the adaptation's prepared data."""
    from peagle_ray.data.prepare import read_prepared

    return [
        s.input_ids[: s.loss_mask.index(1)]
        for s in read_prepared(Path(acfg.data.output_dir), split)
        if s.category == TRAFFIC and 1 in s.loss_mask
    ]


def run_adapt(cfg: PeagleConfig) -> AdaptReport:
    """`peagle-ray adapt`: fine-tune the served drafter on the endpoint's recorded traffic; promote and swap it
    in if better.

    Reads the traffic the endpoint recorded (serving.record_dir, or adapt.traffic_dir), starts from the
    registered version holding adapt.alias, fine-tunes adapt.max_steps steps (capture through the
    Serve-hosted target), measures the served and the new drafter with stock vLLM on the held-out traffic and
    on adapt.general_suite, registers the new version with its parent and measurements, and promotes it
    (moves the alias; swaps it into the endpoint running on this Ray cluster) when held-out AL gains
    adapt.min_gain and the suite loses at most adapt.max_regression. Refuses with no recording, too little
    traffic or no registered version. The report is also written to adapt.json; peagle_ray/adapt.py's
    docstring shows each step."""
    from peagle_ray.capture.run import prepare_and_capture
    from peagle_ray.cluster import ensure_ray
    from peagle_ray.data.sources import check_sources
    from peagle_ray.eval.sweep import set_drafter_k, write_recommendation
    from peagle_ray.export.speculators import read_drafter
    from peagle_ray.serve.app import serving_decoder
    from peagle_ray.tracking import aliased_version, download_version, set_model_tags, tracking_uri
    from peagle_ray.train.job import run_training

    name = registered_name(cfg)
    source = traffic_source(cfg)
    check_sources([source])
    storage = layout.storage(cfg)
    work = layout.adapt_dir(storage, f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")  # one each
    ensure_ray()
    with tracking_uri(cfg, layout.mlflow_dir(storage)) as uri:
        parent = aliased_version(uri, name, cfg.adapt.alias)
        if parent is None:
            raise ConfigError(
                f"no version of registered model {name!r} has the alias {cfg.adapt.alias!r} (adapt.alias) in "
                f"{uri}; train a drafter first (`peagle-ray train` registers it; its first version gets the alias)"
            )
        source, newest = new_traffic(cfg, uri, name)
        parent_dir = download_version(uri, name, parent["version"], work / "parent")
        acfg = adapt_config(cfg, source, work, parent_dir, uri)
        prepared = prepare_and_capture(acfg, prepare=True, capture=False).prepared
        assert prepared is not None  # prepare=True
        samples = prepared.by_category.get(TRAFFIC, {})  # adapt.replay's samples are not traffic
        if samples.get("train", 0) < cfg.adapt.min_requests or not samples.get("validation"):
            raise ConfigError(
                f"too little recorded traffic in {traffic_dir(source)}: {samples.get('train', 0)} training "
                f"and {samples.get('validation', 0)} held-out samples; adapt.min_requests is "
                f"{cfg.adapt.min_requests} and at least one must be held out (bad rows: {prepared.bad_rows})"
            )
        records = sum(split.get("train", 0) for split in prepared.by_category.values())  # traffic and replay
        acfg = with_values(acfg, {"training.epochs": epochs_for(cfg, records)})
        print(f"[adapt] from {name} v{parent['version']} on {samples} recorded samples", flush=True)
        prepare_and_capture(acfg, prepare=False, capture=True)
        trained = run_training(acfg)
        k = cfg.serving.num_speculative_tokens or read_drafter(parent_dir).num_speculative_tokens
        new_dir = Path(trained.export_dir)
        set_drafter_k(new_dir, k)  # served at the K the parent is served at
        measured = judge(cfg, acfg, {"parent": parent_dir, "new": new_dir}, k)
        verdict = decide(cfg, measured["parent"], measured["new"])
        served_dir, served_version, who = (
            (new_dir, trained.registered_version, "new")
            if verdict.promote
            else (parent_dir, parent["version"], "parent")
        )
        serving, decoders = choose_decoder(cfg, acfg, served_dir, k, measured[who].heldout)
        write_recommendation(served_dir, serving)  # serving reads it: the decoder measured fastest
        # what the endpoint serves from it under this config (serving.decoder, a K asked for): the report's
        served = serving_decoder(
            with_values(cfg, {"serving.drafter_version": f"{name}/{served_version}"}), read_drafter(served_dir)
        )
        report = AdaptReport(
            registered_model=name,
            parent_version=parent["version"],
            version=trained.registered_version,
            k=k,
            samples=samples,
            train_steps=cfg.adapt.max_steps,
            measured=measured,
            verdict=verdict,
            decoder=served.decoder,
            recommendation=served.reason,
            export_dir=trained.export_dir,
            run_id=trained.run_id,
            served_dir=str(served_dir),
            served_version=str(served_version),
            decoders=decoders,
        )
        _record(uri, cfg, report)
        set_model_tags(uri, name, {TRAFFIC_UNTIL: repr(newest)})  # the next round starts after it
        report.swapped = _promote(uri, cfg, report, served, (parent_dir, f"{name}/{parent['version']}"))
    work.mkdir(parents=True, exist_ok=True)
    report.json = str(work / "adapt.json")
    Path(report.json).write_text(json.dumps(report.to_json(), indent=2))
    print(f"[adapt] v{report.version}: {report.verdict.why}; promoted: {report.promote}", flush=True)
    print(f"[adapt] serving: {report.recommendation}", flush=True)
    return report


def _record(uri: str, cfg: PeagleConfig, report: AdaptReport) -> None:
    """The measurements as metrics of the adaptation's run and as tags of the new version."""
    from peagle_ray.tracking import log_metrics, set_version_tags

    rows = {
        f"adapt/{part}_al{suffix}": getattr(report.measured[who], part)["acceptance_length"]
        for part in ("heldout", "general")
        for who, suffix in (("parent", "_parent"), ("new", ""))
    }
    rows.update({"adapt/gain": report.verdict.gain, "adapt/promoted": float(report.promote)})
    log_metrics(uri, report.run_id, [(key, value, 0) for key, value in {**rows, **decoder_metrics(report)}.items()])
    if report.version is not None:
        tags = {"parent_version": report.parent_version, "promoted": report.promote, "why": report.verdict.why}
        set_version_tags(uri, registered_name(cfg), report.version, {**tags, **rows})


def decoder_metrics(report: AdaptReport) -> dict[str, float]:
    """Each decoder's held-out AL and speedup, and the hybrid's drafts, accepted tokens and AL per source, as
    MLflow metrics: adapt/decoder_<name>_al, adapt/decoder_<name>_speedup, adapt/hybrid_<source>_drafts ..."""
    out: dict[str, float] = {}
    for name, row in report.decoders.items():
        if "failed" in row:
            continue
        out[f"adapt/decoder_{name}_al"] = row["acceptance_length"]
        out[f"adapt/decoder_{name}_speedup"] = row.get("speedup") or 0.0
        for source, counts in row.get("by_source", {}).items():
            for key in ("drafts", "accepted_tokens", "acceptance_length"):
                out[f"adapt/{name}_{source}_{key}"] = float(counts[key])
    return out


def _promote(uri: str, cfg: PeagleConfig, report: AdaptReport, served, previous: tuple[Path, str]) -> bool:
    """Move the alias to the new version when promoted; record what is to be served (`served`, a
    serve/decoder.ServedDecoder) as the registered model's served.* tags, which `peagle-ray serve` reads; with
    adapt.swap, roll the endpoint running on this cluster onto it first when that changes what it serves.
    True when swapped."""
    from peagle_ray.serve.app import endpoint_running, swap_drafter
    from peagle_ray.tracking import model_tags, set_alias, set_model_tags

    name = registered_name(cfg)
    if report.promote and report.version is not None:
        set_alias(uri, name, cfg.adapt.alias, report.version)
    label = f"{name}/{report.served_version}"
    tags = served_tags(served)
    unchanged = not report.promote and all(model_tags(uri, name).get(key) == tags[key] for key in SAME_SERVING)
    swap = cfg.adapt.swap and not unchanged and endpoint_running()
    if swap:
        swap_drafter(cfg, Path(report.served_dir), label, previous)  # raises, tags untouched, when it fails
        print(f"[adapt] the endpoint now serves {served.describe()} ({label})", flush=True)
    set_model_tags(uri, name, tags)
    return swap


SAME_SERVING = ("served.decoder", "served.k", "served.version")  # equal: the endpoint serves this already


def served_tags(served) -> dict[str, str]:
    """The registered model's tags saying what the endpoint serves (serve/decoder.ServedDecoder)."""
    return {
        "served.decoder": served.decoder,
        "served.k": str(served.k),
        "served.version": served.version or "",
        "served.why": served.reason[:5000],
        "served.dir": served.drafter.path if served.drafter is not None else "",
    }


# ---- continuous mode: `peagle-ray serve --adapt-every MINUTES` ----------------------------------------------


def adapt_cycle(cfg: PeagleConfig) -> AdaptReport | None:
    """One round of the continuous loop: run_adapt's report, or None when this round had nothing to do (too
    little traffic yet) or failed; the endpoint keeps serving either way and the next round tries again."""
    try:
        return run_adapt(cfg)
    except (ConfigError, FileNotFoundError) as err:
        print(f"[adapt] skipped this round: {err}", flush=True)
    except Exception as err:  # noqa: BLE001 - a failed round must not stop the endpoint
        print(f"[adapt] this round failed ({type(err).__name__}: {err}); the endpoint keeps serving", flush=True)
    return None


def serve_adapting(cfg: PeagleConfig, chosen: ServedExport | None, k: int | None, every_minutes: float) -> None:
    """Serve (recording traffic) and adapt every `every_minutes`: each round fine-tunes the version holding
    adapt.alias on the requests recorded since the last round (new_traffic; a round with fewer than
    adapt.min_requests of them is skipped, saying so) and swaps in a promoted one. Ctrl-C / SIGTERM stop it."""
    from ray import serve

    from peagle_ray.serve.app import serve_forever, stop_endpoint

    if cfg.serving.record_dir is None:
        raise ConfigError("--adapt-every needs traffic to learn from: set serving.record_dir; got None")
    if every_minutes <= 0:
        raise ConfigError(f"--adapt-every must be a positive number of minutes; got {every_minutes}")
    serve_forever(cfg, chosen, k, detach=True)
    print(f"[adapt] adapting to the recorded traffic every {every_minutes:g} min", flush=True)
    try:
        while True:
            time.sleep(every_minutes * 60)
            adapt_cycle(cfg)
    finally:
        stop_endpoint()
        serve.shutdown()
