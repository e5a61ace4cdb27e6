"""The training step, as pure functions: no Ray, no MLflow. The Ray Train job wraps `train_step`.

One sequence: COD sampling -> element weights -> partition into segments -> per segment: attention mask,
drafter forward, chunked KL loss, backward (gradients accumulate inside the sequence). Several sequences per
optimizer step accumulate on top. Element weights are fixed for the whole sequence before partitioning, so
the sum of segment losses and gradients is exactly the unpartitioned step's.

On a GPU the host never waits inside the step: every index the segments need is worked out on the CPU first
(plan_segments), the sequence's inputs and that bookkeeping go to the device in one pinned copy, and the
step's metrics are summed on the device and read once, with the gradient norm (`peagle-ray bench host-syncs`
counts both without a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from peagle_ray.config import DrafterConfig, Loss, TrainingConfig
from peagle_ray.drafter.elements import Elements, attention_mask, flex_mask_mod
from peagle_ray.drafter.model import Drafter, depth_bounds_of
from peagle_ray.drafter.teacher import Teacher
from peagle_ray.train.elements import TrainSequence, cod_sample
from peagle_ray.train.loss import LOSS_CHUNK, LossPlan, kl_loss, loss_plan
from peagle_ray.train.partition import Segment, balanced_boundaries, partition
from peagle_ray.train.transfer import to_device

T = TypeVar("T")


@dataclass
class StepStats:
    """Sums over the sequences of a step; per-depth lists have K entries."""

    loss: float = 0.0
    depth_kl: list[float] = field(default_factory=list)  # sum of per-element KL, supervised elements
    depth_correct: list[int] = field(default_factory=list)
    depth_count: list[int] = field(default_factory=list)
    elements: int = 0
    segments: int = 0
    positions: int = 0
    grad_norm: float = 0.0  # global norm before clipping (set by train_step)

    def add(self, other: StepStats) -> None:
        k = max(len(self.depth_count), len(other.depth_count))
        pad = lambda xs: xs + [0] * (k - len(xs))  # noqa: E731
        self.depth_kl = [a + b for a, b in zip(pad(self.depth_kl), pad(other.depth_kl), strict=True)]
        self.depth_correct = [a + b for a, b in zip(pad(self.depth_correct), pad(other.depth_correct), strict=True)]
        self.depth_count = [a + b for a, b in zip(pad(self.depth_count), pad(other.depth_count), strict=True)]
        self.loss += other.loss
        self.elements += other.elements
        self.segments += other.segments
        self.positions += other.positions

    def accuracy(self) -> list[float]:
        return [c / n if n else float("nan") for c, n in zip(self.depth_correct, self.depth_count, strict=True)]


def trained_elements(elements: Elements, seq: TrainSequence) -> torch.Tensor:
    """(E,) bool: the element's predicted token is supervised and its chain stays in one document."""
    pos = elements.position
    return seq.supervised[pos] & (seq.doc_ids[pos] == seq.doc_ids[elements.anchor])


def element_weights(
    elements: Elements, seq: TrainSequence, num_depths: int, depth_weights: list[float] | None
) -> torch.Tensor:
    """(E,) loss weights: the loss is sum_d w_d / sum(w) * mean KL over depth d's trained elements.

    e.g. depths [0,0,0,1], all trained, equal weights, K = 2 -> [1/6, 1/6, 1/6, 1/2].
    """
    weights = torch.tensor(depth_weights or [1.0] * num_depths, dtype=torch.float64)
    trained = trained_elements(elements, seq)
    counts = torch.bincount(elements.depth[trained], minlength=num_depths).to(torch.float64)
    present = counts > 0
    per_depth = torch.where(present, weights / counts.clamp(min=1), 0.0)
    per_depth = per_depth / weights[present].sum() if present.any() else per_depth
    return (per_depth[elements.depth] * trained).to(torch.float32)


def mask_function(elements: Elements, doc_ids: torch.Tensor, use_flex: bool):
    """mask_fn(rows, cols) between element ranges: dense bool for SDPA (CPU), a BlockMask for flex (GPU)."""
    if use_flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def flex(rows: slice, cols: slice):
            q, k = elements.select(rows), elements.select(cols)
            return create_block_mask(flex_mask_mod(q, k, doc_ids), None, None, len(q), len(k), device=doc_ids.device)

        return flex
    return lambda rows, cols: attention_mask(elements.select(rows), elements.select(cols), doc_ids)


class SegmentLoss(torch.nn.Module):
    """One segment's drafter forward and loss as one module forward: what the Ray Train job wraps in torch
    DDP (ray.train.torch.prepare_model), so that DDP sees every parameter the loss uses and averages the
    gradients across workers in its backward hooks."""

    def __init__(self, drafter: Drafter, loss: Loss = "kl"):
        super().__init__()
        self.drafter = drafter
        self.loss = loss

    def forward(self, teacher: Teacher, tokens, hidden, elements: Elements, mask_fn, context: int, rows, teacher_hidden,
                plan: LossPlan, weights, depth_bounds: list[int] | None = None):  # fmt: skip
        out = self.drafter.forward_elements(tokens, hidden, elements, mask_fn, context, depth_bounds)
        norm, head = self.drafter.norm, self.drafter.lm_head.weight
        return kl_loss(norm(out[rows]), head, teacher_hidden, plan, teacher, weights.to(out.dtype), loss=self.loss)


def gradient_sync(loss_module: torch.nn.Module, on: bool):
    """Around one backward: DDP's no_sync() unless `on` (gradients accumulate locally and are averaged across
    workers in the step's last backward); nothing for a module that is not DDP."""
    no_sync = getattr(loss_module, "no_sync", None)
    return contextlib.nullcontext() if on or no_sync is None else no_sync()


@dataclass(frozen=True)
class SegmentWork:
    """One segment's share of a sequence's step, worked out on the host before any device work, so that the
    device loop reads no value back: its elements (context first), how many are context, which of its own
    outputs reach the loss (`rows`: the trained elements), their depths and loss weights, the loss's plan of
    target rows, and where each depth starts among the elements (EAGLE-3's depth-by-depth forward)."""

    elements: Elements
    context: int
    depth_bounds: list[int]
    rows: torch.Tensor  # (R,) long: indices into the segment's own outputs
    depth: torch.Tensor  # (R,) long
    weights: torch.Tensor  # (R,) float32
    plan: LossPlan


def plan_segments(
    elements: Elements,
    segments: list[Segment],
    trained: torch.Tensor,
    weights: torch.Tensor,
    k: int,
    num_positions: int,
    loss_chunk: int,
) -> list[SegmentWork]:
    """The segments holding trained elements, as SegmentWork (host-side bookkeeping, no device)."""
    key = lambda e: e.anchor * k + e.depth  # noqa: E731  unique id of an element
    index_of = torch.full((num_positions * k,), -1, dtype=torch.long)
    index_of[key(elements)] = torch.arange(len(elements))
    work = []
    for segment in segments:
        own_index = index_of[key(segment.own)]
        rows = torch.nonzero(trained[own_index]).squeeze(1)
        if len(rows):
            own = segment.own.select(rows)
            plan = loss_plan(own.position, loss_chunk)
            elements = segment.elements
            work.append(
                SegmentWork(
                    elements,
                    len(segment.context),
                    depth_bounds_of(elements.depth),
                    rows,
                    own.depth,
                    weights[own_index[rows]],
                    plan,
                )
            )
    return work


@dataclass
class PendingStats:
    """A sequence's StepStats whose device-side sums (loss, per-depth KL and correct counts) are not read yet:
    the training step reads those of all its sequences, with the gradient norm, in one copy."""

    stats: StepStats  # what the host knows: counts of elements, segments, positions, per-depth trained elements
    sums: torch.Tensor  # (1 + 2K,) float64 on the device: loss, KL sum per depth, correct per depth

    @staticmethod
    def total(pending: list[PendingStats], grad_norm: torch.Tensor | None = None) -> StepStats:
        """The StepStats of `pending` added up, their sums read once (with `grad_norm`, where given)."""
        stats = StepStats()
        for p in pending:
            stats.add(p.stats)
        values = torch.stack([p.sums for p in pending]).sum(0)
        if grad_norm is not None:
            values = torch.cat([values, grad_norm.detach().to(values).view(1)])
        read = values.tolist()  # the one device-to-host read
        k = len(stats.depth_count)
        stats.loss = read[0]
        stats.depth_kl = read[1 : 1 + k]
        stats.depth_correct = [round(c) for c in read[1 + k : 1 + 2 * k]]
        if grad_norm is not None:
            stats.grad_norm = read[-1]
        return stats


def sequence_backward(*args, **kwargs) -> StepStats:
    """sequence_pass (same arguments), its stats read from the device."""
    return PendingStats.total([sequence_pass(*args, **kwargs)])


def sequence_pass(
    drafter: Drafter,
    teacher: Teacher,
    seq: TrainSequence,
    elements: Elements,
    segment_length: int,
    depth_weights: list[float] | None,
    scale: float = 1.0,
    loss_chunk: int = LOSS_CHUNK,
    boundaries: list[int] | None = None,
    backward: bool = True,
    bf16: bool = False,
    use_flex: bool | None = None,
    loss_module: torch.nn.Module | None = None,
    sync: bool = True,
    loss_kind: Loss = "kl",
) -> PendingStats:
    """Forward + backward of one sequence, segment by segment; gradients accumulate in the parameters.
    With backward=False it only measures (validation): no graph is built. Its stats stay on the device
    (PendingStats): sequence_backward reads them, train_step reads those of all its sequences at once.

    The bookkeeping of every segment is made on the host first (plan_segments) and moved to the device with
    the sequence's inputs in one copy (transfer.to_device): the segment loop reads no value back.

    `loss_module` runs each segment (default: SegmentLoss(drafter, loss_kind)); the job passes it wrapped in DDP, and
    then only the sequence's last backward averages the gradients across workers, and only when `sync` (the
    step's last sequence). A worker whose last sequence trains nothing still joins that average, with a
    zero-weight forward of its first segment (DDP's backward is a collective: every worker must call it).

    `boundaries` overrides the balanced split (tests use it for uneven splits).
    Runs on the drafter's device; `bf16` turns on bfloat16 autocast (the loss's softmax stays float32).
    Attention is compiled flex on CUDA and SDPA with a dense mask elsewhere; `use_flex` overrides that
    (the GPU benchmark measures SDPA on CUDA too).
    """
    k = drafter.arch.num_depths
    weights = element_weights(elements, seq, k, depth_weights) * scale
    trained = trained_elements(elements, seq)
    if boundaries is None:
        boundaries = balanced_boundaries(elements, seq.num_positions, segment_length)
    segments = partition(elements, seq.doc_ids, boundaries)
    work = plan_segments(elements, segments, trained, weights, k, seq.num_positions, loss_chunk)
    stats = StepStats(
        depth_kl=[0.0] * k,
        depth_correct=[0] * k,
        depth_count=torch.bincount(torch.cat([w.depth for w in work]), minlength=k).tolist() if work else [0] * k,
        segments=len(segments),
        elements=len(elements),
        positions=seq.num_positions,
    )
    loss_module = SegmentLoss(drafter, loss_kind) if loss_module is None else loss_module
    joins_only = backward and sync and not work and hasattr(loss_module, "no_sync")
    if joins_only:  # every own element of the first segment, weighted zero
        first, own = segments[0], segments[0].own
        rows = torch.arange(len(own))
        zero = torch.zeros(len(own))
        plan = loss_plan(own.position, loss_chunk)
        work = [SegmentWork(first.elements, len(first.context), depth_bounds_of(first.elements.depth), rows, own.depth,
                            zero, plan)]  # fmt: skip
    device = drafter.embed_tokens.weight.device
    use_flex = device.type == "cuda" if use_flex is None else use_flex
    inputs = (seq.tokens, seq.hidden, seq.teacher_hidden, seq.doc_ids, work)
    tokens, hidden, teacher_hidden, doc_ids, work = to_device(inputs, device)
    sums = torch.zeros(1 + 2 * k, dtype=torch.float64, device=device)
    for n, segment in enumerate(work):  # only trained elements reach the loss
        mask_fn = mask_function(segment.elements, doc_ids, use_flex)
        synced = gradient_sync(loss_module, sync and n == len(work) - 1)  # DDP decides at the forward
        with synced, torch.set_grad_enabled(backward):
            with torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss, kl, correct = loss_module(
                    teacher, tokens, hidden, segment.elements, mask_fn, segment.context, segment.rows,
                    teacher_hidden, segment.plan, segment.weights, segment.depth_bounds,
                )  # fmt: skip
            if backward:
                loss.backward()
        if not joins_only:
            sums[0] += loss.detach()
            sums[1 : 1 + k].index_add_(0, segment.depth, kl.double())
            sums[1 + k :].index_add_(0, segment.depth, correct.double())
    return PendingStats(stats, sums)


def sample_elements(seq: TrainSequence, drafter_cfg: DrafterConfig, generator: torch.Generator) -> Elements:
    """This step's fresh COD sampling of the sequence's elements."""
    return cod_sample(
        seq.supervised,
        seq.doc_ids,
        drafter_cfg.trained_depths,
        drafter_cfg.cod_keep_ratio,
        drafter_cfg.cod_min_ratio,
        generator,
    )


def sampled_sequence_pass(
    drafter: Drafter,
    teacher: Teacher,
    seq: TrainSequence,
    drafter_cfg: DrafterConfig,
    cfg: TrainingConfig,
    generator: torch.Generator,
    scale: float,
    backward: bool = True,
    loss_module: torch.nn.Module | None = None,
    sync: bool = True,
) -> PendingStats:
    """A fresh COD sampling of `seq`, then sequence_pass with the training config's segment length, depth
    weights and precision (the training step, and validation with backward=False); `loss_module` and `sync`
    as there."""
    return sequence_pass(
        drafter,
        teacher,
        seq,
        sample_elements(seq, drafter_cfg, generator),
        cfg.segment_length,
        cfg.depth_weights,
        scale=scale,
        backward=backward,
        bf16=cfg.precision == "bfloat16",
        loss_module=loss_module,
        sync=sync,
        loss_kind=cfg.loss,
    )


def sampled_sequence_backward(*args, **kwargs) -> StepStats:
    """sampled_sequence_pass (same arguments), its stats read from the device."""
    return PendingStats.total([sampled_sequence_pass(*args, **kwargs)])


def with_feature_noise(seq: TrainSequence, scale: float, generator: torch.Generator) -> TrainSequence:
    """`seq` with uniform noise in +-scale x std(hidden) added to its aux hidden states (the drafter's input
    features; the teacher's hidden states, which define the labels, stay exact)."""
    noise = (torch.rand(seq.hidden.shape, generator=generator) * 2 - 1) * (scale * seq.hidden.std())
    return dataclasses.replace(seq, hidden=seq.hidden + noise.to(seq.hidden.dtype))


def make_optimizer(
    drafter: torch.nn.Module, cfg: TrainingConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over trainable parameters; linear warm-up (from 0) then cosine decay to 0 at max_steps
    (warmup_cosine). e.g. warmup 2, max 6, lr 1: 0, 0.5, 1, 0.854, 0.5, 0.146."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    factor = functools.partial(warmup_cosine, warmup=cfg.warmup_steps, total=cfg.max_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The learning-rate factor at `step`: linear from 0 over `warmup` steps, then half a cosine down to 0 at
    `total` -- transformers' get_cosine_schedule_with_warmup, value for value (tests/test_drafter.py compares
    them). Not imported from there: transformers.optimization costs ~7 s of CPU to import, paid by every
    Ray Train worker that starts (twice per run on two workers, again on each restart).

    e.g. warmup 2, total 6: steps 0..5 -> 0, 0.5, 1, 0.854, 0.5, 0.146."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def train_step(
    drafter: Drafter,
    teacher: Teacher,
    optimizer,
    scheduler,
    sequences: list[TrainSequence],
    drafter_cfg: DrafterConfig,
    cfg: TrainingConfig,
    generator: torch.Generator,
    loss_module: torch.nn.Module | None = None,
) -> StepStats:
    """One optimizer step over `sequences` (gradients accumulated across them), with clipping. The step's
    stats and gradient norm are read from the device once, after the optimizer step.

    Distributed training passes `loss_module`, SegmentLoss(drafter) wrapped in DDP: the step's last backward
    averages the gradients across workers, before clipping.
    """
    optimizer.zero_grad(set_to_none=True)
    pending = []
    for n, seq in enumerate(sequences):
        if cfg.feature_noise:
            seq = with_feature_noise(seq, cfg.feature_noise, generator)
        last = n == len(sequences) - 1
        scale = 1.0 / len(sequences)
        pending.append(
            sampled_sequence_pass(drafter, teacher, seq, drafter_cfg, cfg, generator, scale, True, loss_module, last)
        )
    params = [p for p in drafter.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()
    scheduler.step()
    return PendingStats.total(pending, grad_norm)  # the step's one read from the device


Step = Callable[[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, list[TrainSequence]], StepStats]


@dataclass(frozen=True)
class LoopStep:
    """One step of train_loop: its number (from 1), its stats and its wall time."""

    step: int
    stats: StepStats
    seconds: float


def train_loop(
    model: torch.nn.Module,
    items: Sequence[T],
    cfg: TrainingConfig,
    step: Step,
    steps: int | None = None,
    to_sequence: Callable[[T], TrainSequence] | None = None,
) -> Iterator[LoopStep]:
    """The in-process trainer (benchmarks and tests; the Ray Train job runs train_step in its workers): the
    job's optimizer and schedule over `model` (make_optimizer), cycling through `items` in order,
    cfg.sequences_per_step per step, `to_sequence` applied to each as its batch is built; `step(optimizer,
    scheduler, batch)` does one optimizer step (drafter_step: ours). Yields each step as it ends."""
    optimizer, scheduler = make_optimizer(model, cfg)
    per_step = cfg.sequences_per_step
    for index in range(steps or cfg.max_steps):
        batch = [items[(index * per_step + i) % len(items)] for i in range(per_step)]
        sequences = [to_sequence(b) for b in batch] if to_sequence else batch
        started = time.perf_counter()
        stats = step(optimizer, scheduler, sequences)  # type: ignore[arg-type]
        yield LoopStep(index + 1, stats, time.perf_counter() - started)


def drafter_step(
    drafter: Drafter, teacher: Teacher, drafter_cfg: DrafterConfig, cfg: TrainingConfig, generator: torch.Generator
) -> Step:
    """train_step on our drafter, as train_loop's step."""
    return lambda optimizer, scheduler, batch: train_step(
        drafter, teacher, optimizer, scheduler, batch, drafter_cfg, cfg, generator
    )


def train_drafter(
    drafter: Drafter,
    teacher: Teacher,
    sequences: list[TrainSequence],
    drafter_cfg: DrafterConfig,
    cfg: TrainingConfig,
    generator: torch.Generator,
    steps: int | None = None,
) -> list[StepStats]:
    """train_loop with drafter_step to the end: each step's stats."""
    step = drafter_step(drafter, teacher, drafter_cfg, cfg, generator)
    return [done.stats for done in train_loop(drafter, sequences, cfg, step, steps)]
