"""`peagle-ray bench features`: does the drafter draw on the target's hidden states, or mostly on tokens?

On the general capture's validation split (capture.output_dir), for a trained drafter (--peagle DIR, default
the config's own export), four measurements side by side:

  features   the drafter with the target's aux hidden states as captured, zeroed, and shuffled across the
             positions of each record: per-depth accuracy (argmax agreement with the target over the draft
             vocabulary, on every element: no COD drop) and offline greedy acceptance per position and AL
             (greedy replay, which equals vLLM's counters);
  counts     what token statistics alone reach on the same elements: a table from the train split mapping
             the token fed at a position (x_{a+1}) to the target's most frequent choice d + 1 tokens later
             (depth 0: a bigram table; depth d: a skip-gram), the most frequent choice overall for a token
             never seen;
  attention  per query depth, the last layer's attention weight on the element's anchor (the newest real
             position), against a uniform spread over the keys it sees (attention_on_anchor);
  layers     per aux layer of the captured features: max |h| and the channels holding it, the median RMS
             of a position, and their ratio (massive activations: a few channels hundreds of times the rest).

    {"drafter", "records": {"train", "validation"}, "features": {"captured"|"zeroed"|"shuffled":
     {"acc_by_depth", "acceptance_per_position", "acceptance_length"}}, "counts": {"acc_by_depth"},
     "attention_on_anchor": {"mean", "best_head", "uniform"} (per depth),
     "layers": [{"layer", "max_abs", "top_channels", "median_rms", "max_over_median_rms"}]}
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch

from peagle_ray.config import PeagleConfig, with_values
from peagle_ray.layout import VAL_ACCEPTANCE_LENGTH, acceptance_metric
from peagle_ray.options import Opt

if TYPE_CHECKING:
    from peagle_ray.capture.pipeline import Record

FEATURES = ("captured", "zeroed", "shuffled")


def skipgram_table(inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(keys, predictions, fallback): for each distinct input its most frequent label (ties: the smaller
    label), and the most frequent label overall for inputs never seen.

    e.g. inputs [1, 1, 1, 2], labels [5, 5, 6, 7] -> keys [1, 2], predictions [5, 7], fallback 5."""
    labels_range = int(labels.max()) + 1
    pairs, counts = torch.unique(inputs.long() * labels_range + labels.long(), return_counts=True)
    keys, best = pairs // labels_range, pairs % labels_range  # sorted by key, then label
    order = torch.argsort(-counts, stable=True)  # the most frequent first, the smaller label on ties
    order = order[torch.argsort(keys[order], stable=True)]  # grouped by key again, that order kept
    sorted_keys = keys[order]
    first = torch.ones_like(sorted_keys, dtype=torch.bool)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    keys, best = sorted_keys[first], best[order][first]
    fallback = int(torch.bincount(labels.long()).argmax())
    return keys, best, fallback


def predict(table: tuple[torch.Tensor, torch.Tensor, int], inputs: torch.Tensor) -> torch.Tensor:
    """The table's prediction for each input (its fallback for one never seen)."""
    keys, predictions, fallback = table
    if len(keys) == 0:
        return torch.full_like(inputs, fallback)
    at = torch.searchsorted(keys, inputs).clamp(max=len(keys) - 1)
    return torch.where(keys[at] == inputs, predictions[at], torch.full_like(inputs, fallback))


def depth_pairs(tokens: torch.Tensor, labels: torch.Tensor, supervised: torch.Tensor, depth: int):
    """(inputs, labels) of the depth-`depth` elements of one sequence: anchor a feeds tokens[a] (x_{a+1}) and
    is scored on labels[a + depth] (the target's choice for x_{a+2+depth}), when that position is supervised.

    e.g. tokens [10, 11, 12], labels [20, 21, 22], supervised [1, 1, 0], depth 1 -> ([10], [21])."""
    n = tokens.shape[0] - depth
    if n <= 0:
        return tokens[:0], labels[:0]
    keep = supervised[depth:].bool()
    return tokens[:n][keep], labels[depth:][keep]


def teacher_labels(teacher, seq) -> torch.Tensor:
    """The target's greedy choice at each position, as a draft-vocabulary index (what accuracy compares to)."""
    with torch.no_grad():
        return (teacher.normed(seq.teacher_hidden) @ teacher.head.T).argmax(-1)


def count_baseline(teacher, train: list[Record], validation: list[Record], depths: int) -> list[float]:
    """Per depth: the skip-gram table's accuracy on the validation elements, built from the train records."""
    from peagle_ray.train.worker import to_sequence

    def pairs(records):
        seqs = [to_sequence(r) for r in records]
        labelled = [(s, teacher_labels(teacher, s)) for s in seqs]
        return [
            [torch.cat(x) for x in zip(*(depth_pairs(s.tokens, y, s.supervised, d) for s, y in labelled), strict=True)]
            for d in range(depths)
        ]

    accuracy = []
    for (train_in, train_out), (val_in, val_out) in zip(pairs(train), pairs(validation), strict=True):
        if len(val_in) == 0 or len(train_in) == 0:
            accuracy.append(math.nan)
            continue
        guess = predict(skipgram_table(train_in, train_out), val_in)
        accuracy.append(round(float((guess == val_out).float().mean()), 4))
    return accuracy


def with_features(records: list[Record], how: str, seed: int) -> list[Record]:
    """The records with their aux hidden states as captured, zeroed, or shuffled across positions."""
    if how == "captured":
        return records
    generator = torch.Generator().manual_seed(seed)
    out: list[Record] = []
    for record in records:
        aux = record["aux_hidden"].float()
        aux = torch.zeros_like(aux) if how == "zeroed" else aux[torch.randperm(aux.shape[0], generator=generator)]
        out.append({**record, "aux_hidden": aux})
    return out


def layer_statistics(records: list[Record], layer_ids: list[int], top: int = 3) -> list[dict]:
    """Per aux layer over the records: max |h|, the `top` channels by max |h|, the median RMS of a position."""
    aux = torch.cat([torch.as_tensor(r["aux_hidden"]).float() for r in records])
    rows = []
    for layer, chunk in zip(layer_ids, aux.chunk(len(layer_ids), dim=-1), strict=True):
        peak = chunk.abs().amax(0)
        values, channels = peak.topk(min(top, peak.numel()))
        median_rms = float(chunk.pow(2).mean(-1).sqrt().median())
        rows.append(
            {
                "layer": layer,
                "max_abs": round(float(values[0]), 2),
                "top_channels": [[int(c), round(float(v), 2)] for c, v in zip(channels, values, strict=True)],
                "median_rms": round(median_rms, 3),
                "max_over_median_rms": round(float(values[0]) / median_rms, 1) if median_rms else math.inf,
            }
        )
    return rows


def attention_on_anchor(drafter, seq, depths: int) -> dict[str, list[float]]:
    """Per query depth d: the last layer's attention weight (mean over heads and elements) on the element's
    anchor (a, 0), the newest real position it sees, beside what a uniform spread over its visible keys
    would give. A depth-d >= 1 element's own input is constant (the mask token and mask_hidden), so all it
    knows of the text comes through attention: a weight near uniform means it cannot find the last token.

    "best_head" is the head with the most weight on the anchor, per depth."""
    from peagle_ray.drafter.elements import attention_mask
    from peagle_ray.drafter.model import rotate
    from peagle_ray.train.elements import cod_sample

    every = torch.ones_like(seq.supervised)
    elements = cod_sample(every, seq.doc_ids, depths, 1.0, 1.0, torch.Generator().manual_seed(0))
    attn = drafter.layers[-1].self_attn
    seen: dict[str, torch.Tensor] = {}
    hook = attn.register_forward_pre_hook(lambda _m, args: seen.update(x=args[0], positions=args[1]))
    try:
        with torch.no_grad():
            drafter.forward_elements(
                seq.tokens,
                seq.hidden,
                elements,
                lambda r, c: attention_mask(elements.select(r), elements.select(c), seq.doc_ids),
            )
    finally:
        hook.remove()
    a = attn.arch
    with torch.no_grad():
        rope = (seen["positions"], attn.inv_freq, attn.rope_scale)
        q = rotate(attn.q_proj(seen["x"]).view(-1, a.num_heads, a.head_dim), *rope)
        k = rotate(attn.k_proj(seen["x"]).view(-1, a.num_kv_heads, a.head_dim), *rope)
        k = k.repeat_interleave(a.num_heads // a.num_kv_heads, dim=1)
        allowed = attention_mask(elements, elements, seq.doc_ids)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.head_dim)
        weights = scores.masked_fill(~allowed, -math.inf).softmax(-1)  # (heads, E, E)
    # cod_sample puts every position's depth-0 element first, in order: the anchor a's key is element a
    on_anchor = weights[:, torch.arange(len(elements)), elements.anchor]  # (heads, E)
    uniform = 1.0 / allowed.sum(-1).float()
    result: dict[str, list[float]] = {"mean": [], "best_head": [], "uniform": []}
    for d in range(depths):
        rows = elements.depth == d
        if not rows.any():
            continue
        per_head = on_anchor[:, rows].mean(-1)
        result["mean"].append(round(float(per_head.mean()), 4))
        result["best_head"].append(round(float(per_head.max()), 4))
        result["uniform"].append(round(float(uniform[rows].mean()), 4))
    return result


def _mean_over_records(rows: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Element-wise mean of attention_on_anchor's lists over records (depths a record lacks are skipped)."""
    out: dict[str, list[float]] = {}
    for name in rows[0] if rows else ():
        depths = max(len(r[name]) for r in rows)
        out[name] = [
            round(sum(v) / len(v), 4) for d in range(depths) if (v := [r[name][d] for r in rows if d < len(r[name])])
        ]
    return out


def run(
    cfg: PeagleConfig,
    drafters: dict[str, Path],
    validation_records: Annotated[int, Opt("Validation records measured.")] = 16,
    attention_records: int = 4,
    progress=print,
) -> dict:
    """The module docstring's result for the P-EAGLE drafter in `drafters` (--peagle, or the config's export)."""
    from peagle_ray.bench.learning import initial_drafter, split_records
    from peagle_ray.target import read_target_info, resolve_target_path
    from peagle_ray.train.worker import to_sequence, validate

    if "peagle" not in drafters:
        raise FileNotFoundError("bench features needs a P-EAGLE drafter: pass --peagle DIR or train one")
    drafter_dir = Path(drafters["peagle"])
    # every element scored (no COD drop), and the drafter as exported
    fcfg = with_values(cfg, {"training.init_from": str(drafter_dir), "drafter.cod_keep_ratio": 1.0})
    train, validation = split_records(fcfg, validation_records)
    drafter, teacher = initial_drafter(fcfg)
    depths, k = fcfg.drafter.trained_depths, fcfg.drafter.num_depths
    result: dict[str, Any] = {
        "drafter": str(drafter_dir),
        "records": {"train": len(train), "validation": len(validation)},
        "features": {},
    }
    for how in FEATURES:
        val = validate(
            drafter, teacher, with_features(validation, how, cfg.training.seed), fcfg, torch.Generator().manual_seed(0)
        )
        result["features"][how] = {
            "acc_by_depth": [round(val.get(f"val/acc_depth_{d}", math.nan), 4) for d in range(depths)],
            "acceptance_per_position": [round(val[acceptance_metric(i + 1)], 4) for i in range(k)],
            "acceptance_length": round(val[VAL_ACCEPTANCE_LENGTH], 4),
        }
        progress(f"[features] {how}: {result['features'][how]}")
    result["attention_on_anchor"] = _mean_over_records(
        [attention_on_anchor(drafter, to_sequence(r), depths) for r in validation[:attention_records]]
    )
    progress(f"[features] attention on the anchor: {result['attention_on_anchor']}")
    result["counts"] = {"acc_by_depth": count_baseline(teacher, train, validation, depths)}
    progress(f"[features] skip-gram counts: {result['counts']}")
    layer_ids = read_target_info(resolve_target_path(cfg)).aux_layer_ids(cfg.capture.aux_layer_ids)
    result["layers"] = layer_statistics(validation, list(layer_ids))
    return result
