"""`peagle-ray bench adapt-ablation`: why an adaptation reaches the AL it does, and what budget would reach more.

It reuses one adaptation's own inputs (the directory `peagle-ray adapt` leaves: <storage>/adapt/<id>, or
<storage>/bench/adapt/<workload>/train/adapt/<id> after `bench adapt`): the prepared traffic (data/), its
captured shards (hidden/) and the parent drafter (parent/drafter). Every variant starts from that parent
(except where it says otherwise), trains on the same records in the same order with the same seeds in one
process (bench.learning.train_and_measure: the job's own step), and is measured at each budget:

  heldout_al    offline greedy replay of the held-out traffic (the validation split: requests the
                adaptation never trained on), which equals vLLM's acceptance counters;
  general_al    the same on the general capture's validation split (capture.output_dir of the config: the
                data the parent learned), the forgetting side.

A variant is a name and overrides: dotted config overrides (e.g. training.learning_rate=6e-3,
drafter.frozen=[embed_tokens, fc], training.init_from=null for a drafter trained from scratch) and two of
this bench's own: `traffic=F` keeps the first share F of the recorded training requests (data scaling) and
`replay=F` makes share F of the training records general ones (replay against forgetting).

    {"adaptation", "budgets", "records": {...}, "variants": {NAME: {"overrides", "rows": [{"steps",
     "train_seconds", "heldout_al", "heldout_acceptance_per_position", "general_al", ...}, ...]}}}
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch

from peagle_ray.config import ConfigError, PeagleConfig, with_overrides, with_values
from peagle_ray.layout import VAL_ACCEPTANCE_LENGTH, bench_dir, mlflow_dir
from peagle_ray.options import Opt

if TYPE_CHECKING:
    from peagle_ray.capture.pipeline import Record

VARIANTS = {
    "base": [],
    "lr x3": ["training.learning_rate=6.0e-3"],
    "decoder only": ["drafter.frozen=[embed_tokens, fc]"],
    "replay 1:1": ["replay=0.5"],
    "half traffic": ["traffic=0.5"],
    "from scratch": ["training.init_from=null"],
}
OWN = ("traffic", "replay")  # overrides this bench applies itself (not config fields)


def split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, float]]:
    """(config overrides, {"traffic": F, "replay": F}) of one variant; e.g. ["replay=0.5", "a.b=1"] ->
    (["a.b=1"], {"traffic": 1.0, "replay": 0.5})."""
    own = {"traffic": 1.0, "replay": 0.0}
    config = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.strip() not in OWN:
            config.append(override)
            continue
        key, share = key.strip(), float(value)
        if (key == "traffic" and not 0.0 < share <= 1.0) or (key == "replay" and not 0.0 <= share < 1.0):
            raise ConfigError(f"{key} must be a share in (0, 1] for traffic or [0, 1) for replay; got {value!r}")
        own[key] = share
    return config, own


def training_mix(traffic: list[Record], general: list[Record], keep: float, replay: float, seed: int) -> list[Record]:
    """The first `keep` share of the traffic records, plus general records so they are a `replay` share of
    the result, shuffled once with `seed`. e.g. 8 traffic, keep 0.5, replay 0.5 -> 4 traffic + 4 general."""
    kept = traffic[: max(1, round(len(traffic) * keep))]
    wanted = round(len(kept) * replay / (1.0 - replay))
    if wanted > len(general):
        raise ConfigError(
            f"replay={replay} needs {wanted} general training records; the general capture has {len(general)}"
        )
    mix = kept + general[:wanted]
    random.Random(seed).shuffle(mix)
    return mix


def run(
    cfg: PeagleConfig,
    adaptation: Annotated[Path | None, Opt("A directory `peagle-ray adapt` wrote (<storage>/adapt/<id>).")] = None,
    variants: Annotated[
        dict[str, list[str]] | list[list[str]] | None,
        Opt(
            "A variant: its name, then overrides: SECTION.FIELD=VALUE, traffic=SHARE (of the recorded training "
            "requests), replay=SHARE (general records in the mix); repeatable, the first is the baseline; none "
            "given: VARIANTS",
            variants=True,
        ),
    ] = None,
    budgets: Annotated[Sequence[int], Opt("Steps to measure at (one run per variant to the largest).")] = (100, 300),
    general_records: Annotated[int, Opt("General validation records replayed (forgetting).")] = 12,
    progress=print,
) -> dict:
    """The module docstring's result for one adaptation directory."""
    from peagle_ray.bench.learning import split_records, train_and_measure
    from peagle_ray.train.worker import validate

    if adaptation is None:
        raise ConfigError("bench adapt-ablation needs --adaptation DIR (a directory `peagle-ray adapt` wrote)")
    adaptation = Path(adaptation)
    parent = adaptation / "parent" / "drafter"
    for need in (adaptation / "data", adaptation / "hidden", parent):
        if not need.is_dir():
            raise ConfigError(f"--adaptation {adaptation}: {need.name}/ is missing (not an adaptation directory?)")
    if not isinstance(variants, dict):
        variants = {name: overrides for name, *overrides in variants} if variants else VARIANTS
    budgets = sorted(set(budgets))
    general_train, general_val = split_records(cfg, general_records)
    acfg = with_values(
        cfg,
        {
            "data.output_dir": str(adaptation / "data"),
            "capture.output_dir": str(adaptation / "hidden"),
            "training.init_from": str(parent),
            "training.validation_records": None,
        },
    )
    traffic_train, traffic_val = split_records(acfg, None)
    result: dict[str, Any] = {
        "adaptation": str(adaptation),
        "budgets": budgets,
        "records": {
            "traffic_train": len(traffic_train),
            "traffic_heldout": len(traffic_val),
            "general_validation": len(general_val),
        },
        "parent": parent_row(acfg, traffic_val, general_val),
        "variants": {},
    }
    progress(f"[adapt-ablation] the parent, untrained here: {result['parent']}")
    for name, overrides in variants.items():
        config_overrides, own = split_overrides(overrides)
        vcfg = with_values(with_overrides(acfg, config_overrides), {"training.max_steps": max(budgets)})
        seed = vcfg.training.seed
        train = training_mix(traffic_train, general_train, own["traffic"], own["replay"], seed)

        def general(drafter, teacher, steps: int, vcfg=vcfg, seed=seed) -> dict:
            val = validate(drafter, teacher, general_val, vcfg, torch.Generator().manual_seed(seed))
            return {"general_al": round(val[VAL_ACCEPTANCE_LENGTH], 4)}

        progress(f"[adapt-ablation] {name}: {len(train)} training records, {overrides or 'the config alone'}")
        rows = train_and_measure(vcfg, train, traffic_val, budgets, general, progress)
        for row in rows:
            row["heldout_al"] = row.pop("val_acceptance_length")
            row["heldout_acceptance_per_position"] = row.pop("val_acceptance_per_position")
        result["variants"][name] = {"overrides": overrides, "train_records": len(train), "rows": rows}
    return result


def parent_row(cfg: PeagleConfig, heldout: list[Record], general: list[Record]) -> dict:
    """The parent's own held-out traffic and general AL (the variants' step 0)."""
    from peagle_ray.bench.learning import initial_drafter
    from peagle_ray.train.worker import validate

    seed = cfg.training.seed
    drafter, teacher = initial_drafter(cfg)
    al = {}
    for name, records in (("heldout_al", heldout), ("general_al", general)):
        val = validate(drafter, teacher, records, cfg, torch.Generator().manual_seed(seed))
        al[name] = round(val[VAL_ACCEPTANCE_LENGTH], 4)
    return al


def log_to_mlflow(cfg: PeagleConfig, result: dict) -> dict[str, str]:
    """A run `adapt-ablation-<variant>` per variant (step = training steps) with result.json; {variant: run id}."""
    from peagle_ray.tracking import log_rows, tracking_uri

    work = bench_dir(cfg, "adapt-ablation")
    work.mkdir(parents=True, exist_ok=True)
    (work / "result.json").write_text(json.dumps(result, indent=2))
    runs = {}
    with tracking_uri(cfg, mlflow_dir(cfg.training.storage_path)) as uri:
        for name, variant in result["variants"].items():
            rows = [{k: v for k, v in row.items() if isinstance(v, (int, float))} for row in variant["rows"]]
            runs[name] = log_rows(
                uri,
                cfg,
                f"adapt-ablation-{name.replace(' ', '-')}",
                rows,
                "steps",
                "adapt-ablation",
                [work / "result.json"],
                work,
            )
    return runs
