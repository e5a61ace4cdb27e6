"""The teacher: the target's frozen final norm and lm_head rows of the draft vocabulary (H hidden, DV draft
vocabulary). Built with the drafter from the target's weights (drafter/build.py); training's KL loss reads it."""

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
