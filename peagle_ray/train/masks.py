"""The P-EAGLE attention rule, as a dense boolean mask (SDPA) and a flex-attention mask_mod (GPU), and the
amortized mask that is built once and sliced.

Rule, for a query element (a_q, d_q) and a key element (a_k, d_k) of the same document:

    allowed  <=>  (d_k == 0 and a_k <= a_q)        the real causal prefix up to the query's anchor
               or (a_k == a_q and d_k <= d_q)       the earlier slots of the query's own chain

Worked example (positions 0..3 in document 0, 4..5 in document 1; chains (1,*) and (4,*) go 2 deep):

    keys ->        (0,0) (1,0) (2,0) (3,0) (4,0) (5,0) (1,1) (4,1) (1,2)
    query (2,0)      1     1     1     .     .     .     .     .     .
    query (1,1)      1     1     .     .     .     .     1     .     .
    query (1,2)      1     1     .     .     .     .     1     .     1
    query (4,1)      .     .     .     .     1     .     .     1     .     (document 1 only)

The same (anchor, depth) pairs always give the same mask, so a mask built once for a long fixed sampling
holds every shorter one as its top-left block when elements are laid out by position (AmortizedMask).
"""

from __future__ import annotations

import torch

from peagle_ray.drafter.elements import Elements, attention_mask
from peagle_ray.train.elements import cod_sample


def flex_mask_mod(query: Elements, key: Elements, doc_ids: torch.Tensor):
    """The same rule as a flex_attention mask_mod(b, h, q_idx, kv_idx), for create_block_mask on GPU."""
    q_anchor, q_depth, q_doc = query.anchor, query.depth, doc_ids[query.anchor]
    k_anchor, k_depth, k_doc = key.anchor, key.depth, doc_ids[key.anchor]

    def mask_mod(b, h, q_idx, kv_idx):
        same_document = q_doc[q_idx] == k_doc[kv_idx]
        key_is_context = k_depth[kv_idx] == 0
        key_not_after_anchor = k_anchor[kv_idx] <= q_anchor[q_idx]
        same_chain = k_anchor[kv_idx] == q_anchor[q_idx]
        key_earlier_in_chain = k_depth[kv_idx] <= q_depth[q_idx]
        return same_document & ((key_is_context & key_not_after_anchor) | (same_chain & key_earlier_in_chain))

    return mask_mod


def position_major(elements: Elements) -> Elements:
    """Reorder elements by position, then depth: every prefix is then 'all elements before position n'.

    e.g. depth-major (0,0) (1,0) (2,0) (3,0) (1,1) (2,1) (1,2)
      -> position-major (0,0) (1,0) (2,0) (1,1) (3,0) (2,1) (1,2)    positions 0 1 2 2 3 3 3
    """
    order = torch.argsort(elements.position * (int(elements.depth.max()) + 1) + elements.depth, stable=True)
    return elements.select(order)


class AmortizedMask:
    """One COD sampling for `max_positions`, laid out position-major, with its mask built once.

    For any n <= max_positions, the elements at positions < n are a prefix of length E_n, a valid COD
    sampling for n positions (a chain's earlier slots sit at earlier positions), and their mask is exactly
    mask[:E_n, :E_n]. Within one document no per-step work remains; packed documents AND in a same-document
    term. The price is a fixed sampling pattern instead of a fresh one per step.
    """

    def __init__(
        self, max_positions: int, num_depths: int, keep_ratio: float, min_ratio: float, generator: torch.Generator
    ):
        everywhere = torch.ones(max_positions, dtype=torch.bool)
        one_document = torch.zeros(max_positions, dtype=torch.long)
        sampled = cod_sample(everywhere, one_document, num_depths, keep_ratio, min_ratio, generator)
        self.elements = position_major(sampled)
        self.mask = attention_mask(self.elements, self.elements, one_document)  # (E, E)
        # prefix_length[n] = number of elements at positions < n
        self._prefix = torch.searchsorted(self.elements.position, torch.arange(max_positions + 1))
        self.max_positions = max_positions

    def for_length(self, n: int, doc_ids: torch.Tensor | None = None) -> tuple[Elements, torch.Tensor]:
        """Elements and (E_n, E_n) mask for n positions; `doc_ids` (n,) adds document boundaries."""
        if not 0 < n <= self.max_positions:
            raise ValueError(f"n must be in 1..{self.max_positions} (the amortized maximum); got {n}")
        e = int(self._prefix[n])
        elements = self.elements.select(torch.arange(e))
        mask = self.mask[:e, :e]
        if doc_ids is not None and bool((doc_ids != doc_ids[0]).any()):
            doc = doc_ids[elements.anchor]
            mask = mask & (doc[:, None] == doc[None, :])
        return elements, mask
