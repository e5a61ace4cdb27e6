"""What a training run will need, before any GPU is rented: `peagle-ray train --dry-run`.

    plan = plan_training(cfg, target_dir)      # config.json alone: no weights, data or Ray
    print(plan.render())

The drafter is built at full shape on the meta device (no memory), its parameters counted as the run would
train or freeze them, and the bytes one worker holds during a step counted from the shapes. Shape legend:
N positions (data.max_length), K depths, E elements, Q query rows of a segment, R its rows (context + own),
H hidden, A = n_aux * H, I intermediate, DV draft vocabulary, c the loss chunk.

The memory model (bytes per worker; each term a tensor the step holds, in the order the step makes them):
- static: the drafter's parameters and buffers, the teacher head (DV x H), AdamW's two moments of every
  trained parameter, one sequence's inputs (aux and last hidden states, float32);
- a segment's forward saves, per layer, for its R rows: the rotated keys and values, and for layer 0 its
  inputs (aux features twice, fc's output, the embeddings, two norms, the [emb; hidden] concatenation; later
  layers: the residual and a norm); for its Q query rows: queries, attention output, o_proj, residual, a
  norm, the MLP's four I-wide tensors and down_proj; on CPU the dense boolean mask (Q x R); then the final
  norm and the loss's gradient buffer (E x H, four of them);
- the chunked loss holds ~4 (c x DV) float32 arrays (draft logits, softmax, the target's log-probabilities
  and probabilities) and, when the head trains, its gradient (DV x H);
- partitioned, the gradients of the earlier segments are held while a later one runs; the last segment is
  the largest (it carries the whole earlier sequence as depth-0 context when it is one document);
- the optimizer step holds the gradients plus AdamW's foreach temporaries (1.5x the trained bytes, measured
  with torch 2.13 on CPU).
Checked against the live tensor bytes of real CPU steps (tests/test_plan.py, within 20%); under bfloat16 the
matmul outputs count 2 bytes and autocast's bfloat16 weight copies are added. GPU steps (flex attention, no
dense mask) are measured by scripts/gpu_check.sh, which prints this estimate beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from peagle_ray.config import ConfigError, PeagleConfig
from peagle_ray.drafter.model import DrafterArch
from peagle_ray.train.loss import LOSS_CHUNK

FP32 = 4
ADAMW_STEP_TEMPORARIES = 1.5
"""AdamW's foreach temporaries during optimizer.step, as a multiple of the trained parameters' bytes
(measured: 216 MiB over 145 MiB trained, torch 2.13, CPU)."""
LOSS_ARRAYS = 4
"""(c x DV) float32 arrays the chunked loss holds at once: draft logits, softmax, target log-probabilities
and probabilities (train/loss.py)."""


def elements_per_position(num_depths: int, keep: float, floor: float) -> float:
    """COD's expected elements per position: depth d keeps max(keep^d, floor) of the positions.
    e.g. K = 4, 0.7 / 0.2: 1 + 0.7 + 0.49 + 0.343 = 2.533."""
    return sum(max(keep**d, floor) for d in range(num_depths))


@dataclass(frozen=True)
class SegmentShape:
    """The largest segment of one sequence: `segments` of ~`own` elements; the last also carries `context`
    depth-0 rows (the sequence before it, when it is one document)."""

    elements: int
    segments: int
    own: int
    context: int

    @staticmethod
    def of(positions: int, elements: int, segment_length: int) -> SegmentShape:
        """e.g. N = 2048, E = 5188, segment_length 1024: 6 segments of 865, the last after 1707 positions."""
        segments = max(1, math.ceil(elements / segment_length))
        context = positions - math.ceil(positions / segments) if segments > 1 else 0
        return SegmentShape(elements, segments, math.ceil(elements / segments), context)


def activation_bytes(arch: DrafterArch, queries: int, rows: int, dense_mask: bool, bf16: bool) -> int:
    """Bytes a P-EAGLE segment's forward saves for its backward: `rows` (R) run through the stack, the last
    layer's queries narrowed to `queries` (Q, the segment's own elements). Matmul outputs are 2 bytes under
    bfloat16 autocast, everything else float32."""
    h, a, i = arch.hidden_size, arch.num_aux * arch.hidden_size, arch.intermediate_size
    q_width, kv_width = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    mm = 2 if bf16 else FP32  # matmul outputs
    total = 8 * rows + 2 * a * rows * FP32  # token ids; the gathered aux features and their scaled copy
    for layer in range(arch.num_layers):
        q = queries if layer == arch.num_layers - 1 else rows  # only the last layer narrows its queries
        if layer == 0:  # fc output, embeddings, two norms (normalised + scaled), the (R, 2H) concatenation
            inputs = h * rows * mm + h * rows * FP32 + 4 * h * rows * FP32 + 2 * h * rows * FP32
        else:  # residual, input norm
            inputs = 3 * h * rows * FP32
        keys_values = 2 * kv_width * rows * mm
        per_query = (2 * q_width + 2 * h + 4 * i) * mm + 3 * h * FP32  # q, attention out, o/down, MLP; norms
        mask = q * rows if dense_mask else 0  # bool; flex attention builds a block mask instead
        total += inputs + keys_values + per_query * q + mask
    return total + 4 * h * queries * FP32  # the gathered output, final norm (2), the loss's gradient buffer


def loss_bytes(arch: DrafterArch, queries: int, chunk: int, head_trained: bool) -> int:
    """The chunked KL loss's arrays at once, and the head's gradient buffer when it trains."""
    return LOSS_ARRAYS * min(chunk, queries) * arch.draft_vocab_size * FP32 + (
        arch.draft_vocab_size * arch.hidden_size * FP32 if head_trained else 0
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one training worker holds (see the module docstring for what each term counts)."""

    weights: int  # drafter parameters + buffers + teacher head
    optimizer: int  # AdamW moments
    gradients: int
    inputs: int  # one sequence's hidden states
    activations: int  # the largest segment's saved tensors + the loss's arrays
    step: int  # AdamW's temporaries during optimizer.step
    shape: SegmentShape  # the sequence's elements and its largest segment

    @property
    def peak(self) -> int:
        static = self.weights + self.optimizer + self.inputs
        # partitioned, the gradients of the earlier segments are held while a later one runs
        during_forward = static + self.activations + (self.gradients if self.shape.segments > 1 else 0)
        return max(during_forward, static + self.gradients + self.step)


@dataclass(frozen=True)
class TrainPlan:
    target: str
    arch: DrafterArch
    trained_parameters: int
    frozen_parameters: int
    positions: int  # N
    segment_length: int  # training.segment_length
    partitioned: MemoryEstimate
    whole: MemoryEstimate  # one segment per sequence
    workers: str
    refused: list[str] = field(default_factory=list)

    def render(self, gpu_memory_gib: float | None = None) -> str:
        a, s = self.arch, self.partitioned.shape
        gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
        rows = [
            f"target        {self.target}",
            f"drafter       {a.algorithm}, {a.num_layers} layer(s), H {a.hidden_size}, I {a.intermediate_size}, "
            f"heads {a.num_heads}/{a.num_kv_heads} x {a.head_dim}, vocabulary {a.vocab_size:,}, draft vocabulary "
            f"{a.draft_vocab_size:,}, rope {a.rope_parameters}",
            f"parameters    {self.trained_parameters:,} trained, {self.frozen_parameters:,} frozen",
            f"sequence      N = {self.positions:,} positions, K = {a.num_depths}: ~{s.elements:,} elements (COD)",
            f"partitioning  {s.segments} segment(s) of ~{s.own:,} elements (the last with {s.context:,} of context)",
            f"workers       {self.workers}",
            "",
            "| bytes per worker | partitioned | whole sequence |",
            "|---|---:|---:|",
        ]
        for name in ("weights", "optimizer", "gradients", "inputs", "activations", "step"):
            rows.append(f"| {name} | {gib(getattr(self.partitioned, name))} | {gib(getattr(self.whole, name))} |")
        rows.append(f"| **peak** | **{gib(self.partitioned.peak)}** | **{gib(self.whole.peak)}** |")
        refused = list(self.refused)
        if gpu_memory_gib is not None and self.partitioned.peak > gpu_memory_gib * 2**30:
            refused.append(
                f"training.segment_length = {self.segment_length} (segments of ~{s.own:,} elements): the "
                f"partitioned peak {gib(self.partitioned.peak)} exceeds the {gpu_memory_gib:g} GiB per GPU; lower "
                "training.segment_length or data.max_length, or freeze more (drafter.frozen)"
            )
        rows += ["", "refused:" if refused else "refused: nothing", *[f"  - {r}" for r in refused]]
        return "\n".join(rows)


def count_parameters(arch: DrafterArch, cfg: PeagleConfig) -> tuple[int, int, int]:
    """(trained, frozen, buffer bytes) of the drafter the run would build, built on the meta device."""
    from peagle_ray.drafter.build import freeze
    from peagle_ray.drafter.model import Drafter

    with torch.device("meta"):
        drafter = Drafter(arch)
    drafter.lm_head.weight.requires_grad_(not cfg.drafter.freeze_lm_head)
    freeze(drafter, cfg.drafter.frozen)
    trained = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in drafter.parameters() if not p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in drafter.buffers())
    return trained, frozen, buffers


def estimate_memory(
    arch: DrafterArch, cfg: PeagleConfig, positions: int, segment_length: int, trained: int, frozen: int, buffers: int
) -> MemoryEstimate:
    """One worker's bytes for a sequence of `positions` split at `segment_length` elements."""
    d = cfg.drafter
    elements = round(positions * elements_per_position(arch.num_depths, d.cod_keep_ratio, d.cod_min_ratio))
    shape = SegmentShape.of(positions, elements, segment_length)
    bf16 = cfg.training.precision == "bfloat16"
    dense_mask = not cfg.training.use_gpu  # flex attention on CUDA
    activations = activation_bytes(arch, shape.own, shape.own + shape.context, dense_mask, bf16) + loss_bytes(
        arch, shape.own, LOSS_CHUNK, not d.freeze_lm_head
    )
    teacher = (arch.draft_vocab_size + 1) * arch.hidden_size * FP32
    autocast_copies = (trained + frozen - arch.vocab_size * arch.hidden_size) * 2 if bf16 else 0
    inputs = (positions + 1) * ((arch.num_aux + 1) * arch.hidden_size * FP32 + 8)
    return MemoryEstimate(
        weights=(trained + frozen) * FP32 + buffers + teacher,
        optimizer=2 * trained * FP32,
        gradients=trained * FP32,
        inputs=inputs,
        activations=activations + autocast_copies,
        step=round(ADAMW_STEP_TEMPORARIES * trained * FP32),
        shape=shape,
    )


def plan_training(cfg: PeagleConfig, target_dir: str | Path | None = None) -> TrainPlan:
    """The dry run: everything from cfg and `target_dir`/config.json (default target.path), nothing loaded.
    What the run would refuse is listed in `refused` instead of raised, so the whole plan still prints."""
    from peagle_ray.drafter.build import arch_from_config
    from peagle_ray.target import TargetInfo, drafter_rope, read_target_info, text_config

    target = Path(target_dir or cfg.target.path or "")
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"target.path must be a directory with a config.json for a dry run; got {target}")
    info: TargetInfo = read_target_info(target)
    fields, refused = text_config(target), []
    try:
        rope = drafter_rope(fields, f"target {target}/config.json")
    except ConfigError as err:
        refused.append(str(err))
        rope = {"rope_type": "default", "rope_theta": 10000.0}  # the shapes are planned all the same
    try:
        num_aux = len(info.aux_layer_ids(cfg.capture.aux_layer_ids))
    except ConfigError as err:
        refused.append(str(err))
        num_aux = 3
    if cfg.drafter.algorithm != "peagle":
        refused.append(f"drafter.algorithm = {cfg.drafter.algorithm!r}: the memory model covers 'peagle' only")
    if cfg.drafter.draft_vocab_size and cfg.drafter.draft_vocab_size > info.vocab_size:
        refused.append(
            f"drafter.draft_vocab_size = {cfg.drafter.draft_vocab_size} exceeds the target's vocabulary "
            f"({info.vocab_size})"
        )
    draft_vocab = min(cfg.drafter.draft_vocab_size or info.vocab_size, info.vocab_size)
    arch = arch_from_config(fields, rope, cfg.drafter, draft_vocab, info.vocab_size - 1, num_aux)
    trained, frozen, buffers = count_parameters(arch, cfg)
    n, seg = cfg.data.max_length, cfg.training.segment_length
    partitioned = estimate_memory(arch, cfg, n, seg, trained, frozen, buffers)
    whole = estimate_memory(arch, cfg, n, 10**12, trained, frozen, buffers)
    t = cfg.training
    device = "1 GPU" if t.use_gpu else f"{t.cpus_per_worker} CPU(s)"
    workers = (
        f"{t.num_workers} Ray Train worker(s), each {device}, {t.precision}; {t.sequences_per_step} sequence(s) "
        f"per worker per step, {t.max_steps} steps"
    )
    return TrainPlan(
        str(target),
        arch,
        trained,
        frozen,
        n,
        seg,
        partitioned,
        whole,
        workers,
        refused,
    )
