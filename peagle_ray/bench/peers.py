"""`peagle-ray bench peers`: our drafters beside what a user would pick instead, in one run.

On the offline shards (capture.output_dir), from the same initial state of the data:
  ours       P-EAGLE (and EAGLE-3) trained in one process with the job's own step (bench/learning.py);
  reference  speculators 0.9's P-EAGLE (`PEagleDraftModel`: its COD sampling, attention mask and KL loss) on
             the same records in the same order, steps, sequences per step, AdamW lr / weight decay / warm-up
             + cosine schedule / gradient clip, seed, drafter layers, draft vocabulary, mask token and K. Its
             trainer's loop itself (distributed, its data format) is not used: the loop here is ours, the
             forward and loss are theirs. CPU patch at run time: HF's "sdpa" attention instead of compiled
             flex attention (their GPU default). Its weights carry our names (they are the speculators layout
             both sides read), so it is exported and served exactly as ours.
Then, per eval suite (MT-Bench, HumanEval, the validation split), stock vLLM at batch 1 and greedy: the target
alone, both trainers' drafters at K = drafter.num_depths, vLLM's n-gram drafter (prompt lookup) at K = 2..4,
suffix decoding (its suffix tree built by `make setup`; its cache starts empty) and the hybrid (our P-EAGLE
and suffix decoding in one engine, peagle_ray/hybrid.py, its threshold serving.hybrid_threshold; its rows
carry the counts per source): acceptance per position, AL, tokens/s, speedup against the target alone and
mismatches against it. One engine per decoder runs every suite's prompts, so all rows share one run.

The reference is optional: scripts/setup.sh installs it with `pip install --no-deps speculators==0.9.0
hs-connectors==0.9.0` (its own requirements would replace the CPU torch wheel). Without it the reference row
says so and the rest runs.

    {"steps", "records": {"train", "validation"}, "training": {name: {"train_seconds", "tokens_per_s",
     "val_acceptance_length", "val_acceptance_per_position", "val_acc_by_depth", ...}},
     "suites": {suite: {decoder: row}}, "ngram_best": {suite: name}, "goals": {...}}
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch

from peagle_ray.bench.goals import PEERS
from peagle_ray.bench.learning import (
    Progress,
    initial_drafter,
    split_records,
    train_and_measure,
    validation_row,
)
from peagle_ray.config import PeagleConfig, with_values
from peagle_ray.layout import ALGORITHMS, bench_dir, mlflow_dir
from peagle_ray.options import Opt

if TYPE_CHECKING:
    from peagle_ray.capture.pipeline import Record

PEER_INSTALL = "pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0"
SUITES = ("mt-bench", "humaneval", "validation")


def reference_available() -> bool:
    return importlib.util.find_spec("speculators") is not None


def build_reference(target_dir: Path, like, aux_layer_ids: list[int], attention: str = "sdpa"):
    """speculators' PEagleDraftModel for the target, with `like`'s (our drafter's, or anything with its arch,
    d2t and t2d) draft vocabulary, mask token, K and layer count, initialised by speculators itself (its
    mask_hidden, its HF layer init). `attention`: sdpa (the CPU patch), or its GPU default
    simple_flex_attention."""
    from loguru import logger
    from speculators.models.peagle.core import PEagleDraftModel
    from transformers import AutoConfig

    logger.disable("speculators")  # its per-file loading lines; errors still raise
    arch = like.arch
    verifier = AutoConfig.from_pretrained(target_dir)
    verifier = getattr(verifier, "text_config", verifier)
    verifier.num_hidden_layers = arch.num_layers  # the drafter's layers follow the target's layer config
    return PEagleDraftModel.from_training_args(
        verifier,
        t2d=like.t2d.clone(),
        d2t=like.d2t.clone(),
        verifier_name_or_path=str(target_dir),
        target_layer_ids=list(aux_layer_ids),
        draft_vocab_size=arch.draft_vocab_size,
        mask_token_id=arch.mask_token_id,
        num_depths=arch.num_depths,
        norm_before_residual=arch.norm_before_residual,
        draft_attn_impl=attention,
    )


def reference_loss(model, seq, cfg: PeagleConfig, implementation: str = "eager"):
    """speculators' training forward on one of our training sequences (already shifted to positions: token,
    aux hidden, supervised flag and teacher hidden of position p, as their data collator lays them out);
    returns (loss, metrics). `implementation` of its KL loss: eager, or fused (Triton: GPU)."""
    from speculators.losses import resolve_loss_config

    _, loss, metrics = model(
        hidden_states=seq.hidden[None],
        input_ids=seq.tokens[None],
        document_ids=seq.doc_ids[None],
        loss_mask=seq.supervised[None].float(),
        verifier_last_hidden_states=seq.teacher_hidden[None],
        loss_config=resolve_loss_config("kl_div", implementation),
        num_depths=cfg.drafter.trained_depths,
        down_sample_ratio=cfg.drafter.cod_keep_ratio,
        down_sample_ratio_min=cfg.drafter.cod_min_ratio,
    )
    return loss, metrics


def reference_train(model, train: list[Record], cfg: PeagleConfig, progress: Progress = print) -> dict:
    """cfg.training.max_steps steps of the reference on `train` through the same loop as ours (train_loop: the
    same order and batches, the job's optimizer and schedule, its gradient clip); only the step's forward and
    loss are the reference's. Their COD draws from torch's global generator, seeded with training.seed + 1
    (ours: a generator with that seed)."""
    from peagle_ray.train.step import StepStats, train_loop
    from peagle_ray.train.worker import to_sequence

    tcfg = cfg.training
    torch.manual_seed(tcfg.seed + 1)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(optimizer, scheduler, batch) -> StepStats:
        optimizer.zero_grad(set_to_none=True)
        stats = StepStats(positions=sum(s.num_positions for s in batch))
        for seq in batch:
            loss, _ = reference_loss(model, seq, cfg)
            (loss / len(batch)).backward()
            stats.loss += float(loss.detach()) / len(batch)
        stats.grad_norm = float(torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip))
        optimizer.step()
        scheduler.step()
        return stats

    tokens, seconds, loss = 0, 0.0, 0.0
    for done in train_loop(model, train, tcfg, step, to_sequence=to_sequence):
        tokens, seconds, loss = tokens + done.stats.positions, seconds + done.seconds, done.stats.loss
        if done.step % max(1, tcfg.max_steps // 10) == 0:
            progress(json.dumps({"reference_step": done.step, "loss": round(loss, 4)}))
    return {
        "steps": tcfg.max_steps,
        "train_tokens": tokens,
        "train_seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "trainable_parameters": sum(p.numel() for p in params),
        "train_loss": round(loss, 4),
    }


def to_drafter(model, like):
    """Our Drafter holding the reference's weights (same names and shapes: the speculators layout); refuses a
    tensor that does not carry over."""
    drafter = copy.deepcopy(like)
    theirs = {k: v for k, v in model.state_dict().items() if not k.startswith("verifier_")}
    missing, unexpected = drafter.load_state_dict(theirs, strict=False)
    if unexpected or set(missing) - {"feature_scale"}:
        raise ValueError(f"reference weights do not map onto the drafter: missing {missing}, unexpected {unexpected}")
    drafter.feature_scale.fill_(1.0)
    return drafter


def train_all(cfg: PeagleConfig, algorithms, work_dir: Path, progress: Progress) -> tuple[dict, dict, dict]:
    """Train ours (per algorithm) and the reference on the same records; ({name: training row}, {name: export
    dir}, records)."""
    from peagle_ray.export.speculators import export_drafter
    from peagle_ray.train.job import check_inputs

    train, validation = split_records(cfg, cfg.training.validation_records)
    inputs = check_inputs(cfg)
    target_dir, layer_ids, k = inputs.info.path, inputs.aux_layer_ids, cfg.drafter.num_depths
    rows, exports = {}, {}

    for algorithm in algorithms:
        acfg = with_values(cfg, {"drafter.algorithm": algorithm})

        def export(drafter, teacher, steps, name=algorithm):
            exports[name] = export_drafter(drafter, work_dir / name, target_dir, layer_ids, k)
            return {}

        (rows[algorithm],) = train_and_measure(acfg, train, validation, [cfg.training.max_steps], export, progress)

    if not reference_available():
        rows["reference"] = {"skipped": f"speculators is not installed: {PEER_INSTALL}"}
    else:
        pcfg = with_values(cfg, {"drafter.algorithm": "peagle"})
        like, teacher = initial_drafter(pcfg)
        model = build_reference(target_dir, like, layer_ids)
        row = reference_train(model, train, pcfg, progress)
        drafter = to_drafter(model, like)
        row.update(validation_row(pcfg, drafter, teacher, validation))
        progress(json.dumps({"algorithm": "reference", **row}))
        rows["reference"] = row
        exports["reference"] = export_drafter(drafter, work_dir / "reference", target_dir, layer_ids, k)
    return rows, exports, {"train": len(train), "validation": len(validation)}


def suite_prompts(cfg: PeagleConfig, target_dir: Path, suites, per_suite: int, timed_per_suite: int):
    """({"suite/category": prompt ids}, {"suite/category": timed count}): about `per_suite` prompts per suite
    spread over its categories, the first `timed_per_suite` of them timed at batch 1."""
    from peagle_ray.eval.sweep import eval_prompts

    prompts, timing = {}, {}
    for suite in suites:
        found = eval_prompts(
            with_values(cfg, {"eval.suite": suite, "eval.prompts_per_category": per_suite}), target_dir
        )
        each, timed = max(1, per_suite // len(found)), max(1, timed_per_suite // len(found))
        for category, ids in found.items():
            prompts[f"{suite}/{category}"] = ids[:each]
            timing[f"{suite}/{category}"] = min(timed, len(ids[:each]))
    return prompts, timing


def measure(cfg: PeagleConfig, exports: dict, suites, per_suite: int, timed: int, ngram_k, progress) -> dict:
    """{suite: {decoder: row or note}}: one engine per decoder over every suite's prompts (eval.compare)."""
    from peagle_ray.eval import compare
    from peagle_ray.target import resolve_target_path

    target = resolve_target_path(cfg)
    prompts, timing = suite_prompts(cfg, target, suites, per_suite, timed)
    k = cfg.drafter.num_depths
    candidates = [compare.drafter(name, path, k) for name, path in exports.items()]
    candidates += [compare.ngram(n, f"ngram-k{n}") for n in ngram_k] + [compare.suffix(k)]
    if "peagle" in exports:
        candidates.append(compare.hybrid("hybrid", exports["peagle"], k, cfg.serving.hybrid_threshold))
    say = lambda what: progress(f"bench peers: measuring {what} on {', '.join(suites)}")  # noqa: E731
    judged = compare.compare(cfg, target, candidates, prompts, timing, say)
    return {s: judged.overall(in_suite(s)) for s in suites}


def in_suite(suite: str) -> Callable[[str], bool]:
    """Whether a category ("suite/category", suite_prompts' names) belongs to `suite`."""
    return lambda category: category.startswith(f"{suite}/")


def best_ngram(rows: dict) -> str | None:
    """The n-gram row with the most tokens/s (None when none ran)."""
    ran = {n: r for n, r in rows.items() if n.startswith("ngram") and "tokens_per_s" in r}
    return max(sorted(ran), key=lambda n: ran[n]["tokens_per_s"]) if ran else None


def goals(result: dict) -> dict:
    """The issue's goals, each (measured ratio or value, met) where measurable."""
    out = {}
    training = result["training"]
    ours, ref = training.get("peagle", {}), training.get("reference", {})
    if "val_acceptance_length" in ref and "val_acceptance_length" in ours:
        ratio = ours["val_acceptance_length"] / ref["val_acceptance_length"]
        out["validation_al_vs_reference"] = (round(ratio, 3), ratio >= PEERS["al_vs_reference"])
    for suite, rows in result["suites"].items():
        if "acceptance_length" in rows.get("reference", {}) and "acceptance_length" in rows.get("peagle", {}):
            ratio = rows["peagle"]["acceptance_length"] / rows["reference"]["acceptance_length"]
            out[f"{suite}_al_vs_reference"] = (round(ratio, 3), ratio >= PEERS["al_vs_reference"])
        out.update(hybrid_goals(suite, rows))
        best = result["ngram_best"].get(suite)
        if best and "speedup" in rows.get("peagle", {}):
            out[f"{suite}_speedup_vs_{best}"] = (
                rows["peagle"]["speedup"],
                rows["peagle"]["speedup"] >= rows[best]["speedup"],
            )
    return out


def hybrid_goals(suite: str, rows: dict) -> dict:
    """Issue 37's goals for the hybrid on one suite, against the better of its two sources (P-EAGLE alone and
    suffix decoding): AL at least the larger AL; speed at least the faster's within one standard error of
    each; and its speed over the faster's (>= 1.1 on one suite is the goal).

    e.g. hybrid AL 2.1 at 1.5x +- 0.1, suffix AL 2.0 at 1.6x +- 0.1, peagle AL 1.2 at 0.9x -> AL met, speed met
    (1.5 + 0.1 >= 1.6 - 0.1), ratio 0.938."""
    hybrid = rows.get("hybrid", {})
    sources = [rows[name] for name in ("peagle", "suffix") if "speedup" in rows.get(name, {})]
    if "speedup" not in hybrid or len(sources) < 2:
        return {}
    best_al = max(row["acceptance_length"] for row in sources)
    faster = max(sources, key=lambda row: row["speedup"])
    spread = (hybrid.get("speedup_se") or 0) + (faster.get("speedup_se") or 0)
    ratio = round(hybrid["speedup"] / faster["speedup"], 3)
    return {
        f"{suite}_hybrid_al_vs_best": (
            round(hybrid["acceptance_length"] / best_al, 3),
            hybrid["acceptance_length"] >= best_al,
        ),
        f"{suite}_hybrid_speed_within_spread": (ratio, hybrid["speedup"] + spread >= faster["speedup"]),
        f"{suite}_hybrid_speed_vs_faster": (ratio, ratio >= 1.1),
    }


def run(
    cfg: PeagleConfig,
    steps: Annotated[int | None, Opt("Training steps of every trainer (default training.max_steps).")] = None,
    algorithms: Annotated[tuple[str, ...], Opt("Our algorithms trained.", choices=ALGORITHMS)] = ("peagle", "eagle3"),
    suites: Annotated[Sequence[str], Opt("Eval suites.", choices=SUITES)] = SUITES,
    prompts: Annotated[int, Opt("Prompts per suite (spread over its categories).")] = 16,
    timed: Annotated[int, Opt("Prompts per suite timed at batch 1 (the rest only count acceptance).")] = 8,
    ngram_k: Annotated[tuple[int, ...], Opt("K values of vLLM's n-gram drafter.")] = (2, 3, 4),
    progress: Progress = print,
) -> dict:
    """Train ours and the reference for `steps` (default training.max_steps), then measure every decoder on
    `suites` (about `prompts` prompts per suite, `timed` of them timed at batch 1)."""
    steps = steps or cfg.training.max_steps
    cfg = with_values(cfg, {"training.max_steps": steps})
    work_dir = bench_dir(cfg, "peers")
    suites = list(suites)
    training, exports, records = train_all(cfg, list(algorithms), work_dir, progress)
    result: dict[str, Any] = {
        "steps": steps,
        "k": cfg.drafter.num_depths,
        "records": records,
        "training": training,
        "reference": "speculators 0.9.0 PEagleDraftModel (its forward, COD and KL loss; our loop and schedule)",
    }
    result["suites"] = measure(cfg, exports, suites, prompts, timed, list(ngram_k), progress)
    result["ngram_best"] = {s: best_ngram(rows) for s, rows in result["suites"].items()}
    result["goals"] = goals(result)
    return result


def log_to_mlflow(cfg: PeagleConfig, result: dict) -> dict[str, str]:
    """One run `bench-peers`: per suite and decoder its numeric fields (`bench-peers/<suite>_<decoder>_<field>`),
    the training rows, and result.json."""
    from peagle_ray.tracking import log_rows, tracking_uri

    work = bench_dir(cfg, "peers")
    work.mkdir(parents=True, exist_ok=True)
    (work / "result.json").write_text(json.dumps(result, indent=2))
    flat = {"step": result["steps"]}
    for suite, rows in result["suites"].items():
        for decoder, row in rows.items():
            flat.update({f"{suite}_{decoder}_{k}": v for k, v in row.items() if isinstance(v, (int, float, list))})
    for name, row in result["training"].items():
        flat.update({f"train_{name}_{k}": v for k, v in row.items() if isinstance(v, (int, float, list))})
    with tracking_uri(cfg, mlflow_dir(cfg.training.storage_path)) as uri:
        return {
            "bench-peers": log_rows(
                uri, cfg, "bench-peers", [flat], "step", "bench-peers", [work / "result.json"], work
            )
        }
