"""Forward KL(target || draft) over the draft vocabulary, without ever holding all elements x vocabulary.

Shape legend: E elements, P positions, U distinct positions in a chunk, H hidden, DV draft vocabulary.

The target's distribution for an element comes from the target's own head: final norm, then the lm_head
rows of the draft vocabulary, applied to the target's last-layer (pre-norm) hidden state at the element's
position. COD puts up to K elements on one position (depths 0..K-1 of different chains), so elements are
sorted by position and the target's distribution is computed once per distinct position of each chunk
(e.g. K = 4, 0.7 / 0.2 ratios: ~2.5 elements per position, so ~60% of the teacher GEMMs and softmaxes are
saved). The draft logits are made `chunk` elements at a time and the gradient of each chunk is formed at
once, folded into the gradients of the hidden states and the draft lm_head (skipped when the head is
frozen) through GEMMs (see _ChunkedKL), so peak memory is O(chunk x DV) instead of O(E x DV).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from peagle_ray.config import Loss
from peagle_ray.drafter.teacher import Teacher

LOSS_CHUNK = 1024
"""Elements whose draft logits (chunk x DV) are in memory at once: bounds the loss's peak memory (64 MB of
float32 at DV 16384), not its value; larger chunks make fewer, larger GEMMs."""


@dataclass(frozen=True)
class LossPlan:
    """Which target row supervises each element, worked out on the host before the device computes (the
    training step builds it with the segment's other bookkeeping: the device then reads no value back).

    used (U,): the distinct positions of the elements, ascending (rows of the target's hidden states normed);
    order (E,): the elements sorted by position, stable (a position's elements side by side, chunk by chunk);
    of_row (E,): for order[i], its row among its chunk's distinct positions; chunk_positions: each chunk's
    distinct positions (indices into `used`), concatenated; chunk_sizes: how many each chunk has.

    e.g. positions [5, 3, 5, 9], chunk 2 -> used [3, 5, 9], order [1, 0, 2, 3], chunks (1, 0) and (2, 3):
    chunk_positions [0, 1, 1, 2], chunk_sizes (2, 2), of_row [0, 1, 0, 1].
    """

    used: torch.Tensor
    order: torch.Tensor
    of_row: torch.Tensor
    chunk_positions: torch.Tensor
    chunk_sizes: tuple[int, ...]
    chunk: int


def loss_plan(teacher_index: torch.Tensor, chunk: int = LOSS_CHUNK) -> LossPlan:
    """The LossPlan of elements supervised at positions `teacher_index` (E,), `chunk` elements at a time."""
    used, index = torch.unique(teacher_index, return_inverse=True)
    order = torch.argsort(index, stable=True)
    parts = [
        torch.unique_consecutive(index[order[s : s + chunk]], return_inverse=True) for s in range(0, len(index), chunk)
    ]
    empty = torch.zeros(0, dtype=torch.long)
    return LossPlan(
        used,
        order,
        torch.cat([of_row for _, of_row in parts]) if parts else empty,
        torch.cat([positions for positions, _ in parts]) if parts else empty,
        tuple(len(positions) for positions, _ in parts),
        chunk,
    )


class _ChunkedKL(torch.autograd.Function):
    """Per chunk, with z = x W^T the draft logits, q = softmax(z), p the target's distribution:
        KL(p || q) = sum_v p log p - p . z + logsumexp(z),   and  p . z = x . (p W)
        d KL / d x = q W - p W,   d KL / d W = (q - p)^T x
    so the target side needs only p W (U, H) and its entropy per distinct position, and no (c, DV) array
    other than z and q is ever made: no gathered p, no log q, no (q - p) (they were ~40% of the step).
    Every index comes from the LossPlan: nothing here reads a value back from the device."""

    @staticmethod
    def forward(ctx, x, weight, teacher_x, plan: LossPlan, teacher_weight, element_weights, hard: bool):
        """x (E, H) normed draft hidden, weight (DV, H), teacher_x (U, H) the target's normed hidden at
        plan.used; returns (weighted KL sum, per-element KL, correct). `hard`: p is one-hot on the target's
        argmax (its entropy 0), so the KL is the cross-entropy of the target's greedy token."""
        acc = torch.promote_types(x.dtype, torch.float32)  # softmax and KL in at least float32
        device = x.device.type
        # GEMM operands cast once per call (under autocast a frozen head and the teacher head, which are no
        # grad-requiring leaves, would otherwise be re-cast at every product)
        autocasting = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        mm = torch.get_autocast_dtype(device) if autocasting else x.dtype
        w_mm, teacher_w_mm, x_mm = weight.to(mm), teacher_weight.to(mm), x.to(mm)
        grad_x = torch.zeros_like(x)
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=acc, device=x.device)
        kl = torch.empty(x.shape[0], dtype=acc, device=x.device)
        correct = torch.empty(x.shape[0], dtype=torch.bool, device=x.device)
        first = 0  # of this chunk's distinct positions in plan.chunk_positions
        with torch.autocast(device, enabled=False) if autocasting else contextlib.nullcontext():
            for start, distinct in zip(range(0, x.shape[0], plan.chunk), plan.chunk_sizes, strict=True):
                rows = plan.order[start : start + plan.chunk]
                of_row = plan.of_row[start : start + plan.chunk]
                positions = plan.chunk_positions[first : first + distinct]
                first += distinct
                # target side, once per distinct position
                log_p = torch.log_softmax(teacher_x[positions].to(mm) @ teacher_w_mm.T, -1, dtype=acc)  # (U, DV)
                if hard:
                    p = torch.zeros_like(log_p).scatter_(-1, log_p.argmax(-1, keepdim=True), 1.0)
                    neg_entropy = torch.zeros(distinct, dtype=acc, device=x.device)
                else:
                    p = log_p.exp()
                    neg_entropy = (p * log_p).sum(-1)  # (U,)
                p_w = (p.to(mm) @ w_mm).to(acc)  # (U, H): p W
                # draft side
                xr = x_mm[rows]
                draft_logits = xr @ w_mm.T  # (c, DV)
                q = torch.log_softmax(draft_logits, -1, dtype=acc)
                lse = draft_logits[:, 0].to(acc) - q[:, 0]  # logsumexp(z), read off log q = z - logsumexp(z)
                q = q.exp_()
                correct[rows] = q.argmax(-1) == log_p.argmax(-1)[of_row]
                row_kl = neg_entropy[of_row] - (xr.to(acc) * p_w[of_row]).sum(-1) + lse
                kl[rows] = row_kl
                w = element_weights[rows].to(acc)
                total += (row_kl * w).sum()
                q_w = (q.to(mm) @ w_mm).to(acc)  # (c, H): q W
                grad_x[rows] = ((q_w - p_w[of_row]) * w[:, None]).to(grad_x.dtype)
                if grad_w is not None:
                    wx = xr.to(acc) * w[:, None]  # (c, H)
                    per_position = torch.zeros(distinct, x.shape[1], dtype=acc, device=x.device)
                    per_position.index_add_(0, of_row, wx)  # sum of w x over a position's elements
                    grad_w += (q.to(mm).T @ wx.to(mm) - p.to(mm).T @ per_position.to(mm)).to(grad_w.dtype)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.mark_non_differentiable(kl, correct)
        return total, kl, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_kl, _grad_correct):
        grad_x, grad_w = ctx.saved_tensors
        grad_w = None if grad_w is None else grad_w * grad_total
        return (grad_x * grad_total, grad_w, None, None, None, None, None)


def kl_loss(
    draft_normed: torch.Tensor,
    draft_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_index: torch.Tensor | LossPlan,
    teacher: Teacher,
    element_weights: torch.Tensor,
    chunk: int = LOSS_CHUNK,
    loss: Loss = "kl",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted sum of per-element KL(target || draft), the per-element KL (detached) and argmax agreement;
    with loss "argmax_ce" the cross-entropy of the target's argmax token instead of the KL (training.loss).

    draft_normed (E, H): the drafter's final-norm output; draft_head (DV, H): its lm_head weight;
    teacher_hidden (P, H): the target's pre-norm last hidden state per position; teacher_index (E,): the
    position whose target distribution supervises each element, or its LossPlan made ahead on the host
    (then `chunk` is the plan's).
    """
    plan = teacher_index if isinstance(teacher_index, LossPlan) else loss_plan(teacher_index, chunk)
    with torch.no_grad():
        teacher_x = teacher.normed(teacher_hidden[plan.used])  # normalise only the rows in use
    hard = loss == "argmax_ce"
    return _ChunkedKL.apply(draft_normed, draft_head, teacher_x, plan, teacher.head, element_weights, hard)


def kl_loss_reference(
    draft_normed, draft_head, teacher_hidden, teacher_index, teacher: Teacher, element_weights, loss: Loss = "kl"
):
    """The same loss written plainly (all E x DV at once, a target row per element), to test against."""
    log_q = torch.log_softmax(draft_normed @ draft_head.T, -1)
    log_p = torch.log_softmax(teacher.normed(teacher_hidden[teacher_index]) @ teacher.head.T, -1)
    if loss == "argmax_ce":
        return (-log_q.gather(1, log_p.argmax(-1, keepdim=True)).squeeze(1) * element_weights).sum()
    return ((log_p.exp() * (log_p - log_q)).sum(-1) * element_weights).sum()
