"""Sequence partitioning (P-EAGLE paper, Algorithm 1): one long sequence's elements split into segments that
run forward and backward one at a time, with gradients accumulated inside the sequence.

Which segment owns an element: depth-0 and depth-1 elements belong to the segment holding their position;
a deeper element inherits its chain's depth-1 segment (position anchor + 1). Each segment also carries, as
context, the earlier depth-0 elements its own elements attend to (from the start of the earliest document
it touches). Context elements are recomputed with gradients but contribute no loss, so the segment losses
and gradients sum exactly to the unpartitioned step's.

Worked example: N = 6 positions, boundaries [0, 3, 6], elements (depth-major)
    (0,0) (1,0) (2,0) (3,0) (4,0) (5,0) (2,1) (4,1) (2,2)
    segment 0 owns (0,0) (1,0) (2,0)                     context: none
    segment 1 owns (3,0) (4,0) (5,0) (2,1) (4,1) (2,2)   context: (0,0) (1,0) (2,0)
(2,1) sits at position 3, so segment 1 owns it and its deeper slot (2,2); they attend to (2,0), carried as
context.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from peagle_ray.drafter.elements import Elements


@dataclass(frozen=True)
class Segment:
    context: Elements  # depth-0 elements before the segment that its elements attend to; no loss here
    own: Elements  # elements whose loss this segment computes, depth-major

    @property
    def elements(self) -> Elements:
        """Context first, then own: still depth-major, as the EAGLE-3 step-by-step forward needs."""
        return Elements.cat([self.context, self.own])


def owner_position(elements: Elements) -> torch.Tensor:
    """Position that decides an element's segment: its own for depth 0, its chain's depth-1 slot otherwise."""
    return torch.where(elements.depth == 0, elements.anchor, elements.anchor + 1)


def balanced_boundaries(elements: Elements, num_positions: int, segment_length: int) -> list[int]:
    """Segment boundaries [0, b_1, ..., N] so that each segment owns about `segment_length` elements.

    e.g. the 9 elements of the module example (owner positions 0,1,2,3,4,5,3,5,3) with segment_length 5:
    2 segments of 4.5; the cumulative counts per position are 1,2,3,6,7,9, first reaching 4.5 at position 3
    -> boundaries [0, 3, 6].
    """
    total = len(elements)
    num_segments = max(1, -(-total // segment_length))
    if num_segments == 1:
        return [0, num_positions]
    per_position = torch.bincount(owner_position(elements), minlength=num_positions)
    cumulative = torch.cumsum(per_position, 0)
    # cut before the first position whose cumulative count reaches the s-th share
    cuts = [int(torch.searchsorted(cumulative, total * s / num_segments)) for s in range(1, num_segments)]
    return sorted({0, num_positions, *[c for c in cuts if 0 < c < num_positions]})


def partition(elements: Elements, doc_ids: torch.Tensor, boundaries: list[int]) -> list[Segment]:
    """Split depth-major `elements` at position `boundaries` (0 = b_0 < b_1 < ... < b_S = N)."""
    n = doc_ids.shape[0]
    if boundaries[0] != 0 or boundaries[-1] != n or any(a >= b for a, b in itertools.pairwise(boundaries)):
        raise ValueError(f"boundaries must rise strictly from 0 to {n} (the number of positions); got {boundaries}")
    segment_of = torch.bucketize(owner_position(elements), torch.tensor(boundaries[1:-1]), right=True)
    # first position of each position's document: context starts there
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = doc_ids[1:] != doc_ids[:-1]
    doc_start = torch.cummax(torch.where(starts, torch.arange(n), 0), 0).values

    segments = []
    for s, begin in enumerate(boundaries[:-1]):
        own = elements.select(torch.nonzero(segment_of == s).squeeze(1))
        if len(own) == 0:
            continue
        first = int(doc_start[own.anchor.min()])
        context_anchors = torch.arange(first, begin)
        segments.append(Segment(Elements(context_anchors, torch.zeros_like(context_anchors)), own))
    return segments
