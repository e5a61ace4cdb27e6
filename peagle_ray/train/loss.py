"""Forward KL(target || draft) over the draft vocabulary, without ever holding all elements x vocabulary.

Shape legend: E elements, P positions, U distinct positions in a chunk, H hidden, DV draft vocabulary.

The target's distribution for an element comes from the target's own head: final norm, then the lm_head
rows of the draft vocabulary, applied to the target's last-layer (pre-norm) hidden state at the element's
position. COD puts up to K elements on one position (depths 0..K-1 of different chains), so elements are
sorted by position and the target's distribution is computed once per distinct position of each chunk
(e.g. K = 4, 0.7 / 0.2 ratios: ~2.5 elements per position, so ~60% of the teacher GEMMs and softmaxes are
saved). The draft and target logits are made `chunk` elements at a time; the gradient of each chunk is
formed at once (d KL / d logits = softmax(draft) - softmax(target)) and folded into the gradients of the
hidden states and the draft lm_head (skipped when the head is frozen), so peak memory is O(chunk x DV)
instead of O(E x DV).
"""

from __future__ import annotations

import torch
from torch import nn


class Teacher(nn.Module):
    """The frozen target head restricted to the draft vocabulary."""

    def __init__(self, norm_weight: torch.Tensor, head: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight.detach().clone())  # (H,)
        self.register_buffer("head", head.detach().clone())  # (DV, H)
        self.eps = eps

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(hidden.dtype) * self.norm_weight


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, teacher_x, teacher_index, teacher_weight, element_weights, chunk: int):
        """x (E, H) normed draft hidden, weight (DV, H), teacher_x (P, H) normed target hidden, teacher_index
        (E,) the row of teacher_x each element is supervised by; returns (weighted KL sum, per-element KL,
        correct)."""
        acc = torch.promote_types(x.dtype, torch.float32)  # softmax and KL in at least float32
        grad_x = torch.zeros_like(x)
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=acc, device=x.device)
        kl = torch.empty(x.shape[0], dtype=acc, device=x.device)
        correct = torch.empty(x.shape[0], dtype=torch.bool, device=x.device)
        order = torch.argsort(teacher_index, stable=True)  # elements of one position side by side
        for start in range(0, x.shape[0], chunk):
            rows = order[start : start + chunk]
            positions, of_row = torch.unique_consecutive(teacher_index[rows], return_inverse=True)
            target_logits = (teacher_x[positions] @ teacher_weight.T).to(acc)  # (U, DV)
            log_p = torch.log_softmax(target_logits, -1)
            p = log_p.exp()
            neg_entropy = (p * log_p).sum(-1)  # (U,)
            p = p[of_row]  # (c, DV)
            xr = x[rows]
            draft_logits = (xr @ weight.T).to(acc)  # (c, DV)
            log_q = torch.log_softmax(draft_logits, -1)
            kl[rows] = (neg_entropy[of_row] - (p * log_q).sum(-1)).to(acc)
            correct[rows] = draft_logits.argmax(-1) == target_logits.argmax(-1)[of_row]
            w = element_weights[rows].to(acc)
            total += (kl[rows] * w).sum()
            g = ((log_q.exp() - p) * w[:, None]).to(x.dtype)  # d total / d draft_logits, (c, DV)
            grad_x[rows] = (g @ weight).to(grad_x.dtype)  # autocast may hand back bfloat16
            if grad_w is not None:
                grad_w += (g.T @ xr).to(grad_w.dtype)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.mark_non_differentiable(kl, correct)
        return total, kl, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_kl, _grad_correct):
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * grad_total, None if grad_w is None else grad_w * grad_total, None, None, None, None, None)


def kl_loss(
    draft_normed: torch.Tensor,
    draft_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_index: torch.Tensor,
    teacher: Teacher,
    element_weights: torch.Tensor,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted sum of per-element KL(target || draft), the per-element KL (detached) and argmax agreement.

    draft_normed (E, H): the drafter's final-norm output; draft_head (DV, H): its lm_head weight;
    teacher_hidden (P, H): the target's pre-norm last hidden state per position; teacher_index (E,): the
    position whose target distribution supervises each element.
    """
    with torch.no_grad():
        used, index = torch.unique(teacher_index, return_inverse=True)  # normalise only the rows in use
        teacher_x = teacher.normed(teacher_hidden[used])
    return _ChunkedKL.apply(draft_normed, draft_head, teacher_x, index, teacher.head, element_weights, chunk)


def kl_loss_reference(draft_normed, draft_head, teacher_hidden, teacher_index, teacher: Teacher, element_weights):
    """The same loss written plainly (all E x DV at once, a target row per element), to test against."""
    log_q = torch.log_softmax(draft_normed @ draft_head.T, -1)
    log_p = torch.log_softmax(teacher.normed(teacher_hidden[teacher_index]) @ teacher.head.T, -1)
    return ((log_p.exp() * (log_p - log_q)).sum(-1) * element_weights).sum()
