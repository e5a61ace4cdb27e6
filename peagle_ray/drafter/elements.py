"""Elements (anchor, depth) and the P-EAGLE attention rule between them: what the drafter computes over, in
training and in drafting alike. The rule in two forms: a dense boolean mask (SDPA, CPU) and a flex-attention
mask_mod (create_block_mask, GPU). It is rebuilt for each step's fresh COD sampling: that costs 0.6% of a
training step at N = 1024, K = 4 and 1.8% at N = 2048, K = 8 (`peagle-ray bench mask`).

Shape legend: E elements, Eq / Ek query / key elements.

Elements. An element is (anchor a, depth d): it sits at position a + d and predicts the token after position
a + d. Depth 0 is the next-token (NTP) element of position a; depth d >= 1 is the d-th mask slot of the chain
anchored at a. Worked example, N = 6, one document, K = 3:

    depth 0: (0,0) (1,0) (2,0) (3,0) (4,0) (5,0)     every position, always
    depth 1: (1,1) (3,1) (4,1)                       chains whose depth-0 element exists, sampled
    depth 2: (3,2)                                   only chains that kept depth 1

Rule, for a query element (a_q, d_q) and a key element (a_k, d_k) of the same document:

    allowed  <=>  (d_k == 0 and a_k <= a_q)        the real causal prefix up to the query's anchor
               or (a_k == a_q and d_k <= d_q)       the earlier slots of the query's own chain

Worked example (positions 0..3 in document 0, 4..5 in document 1; chains (1,*) and (4,*) go 2 deep):

    keys ->        (0,0) (1,0) (2,0) (3,0) (4,0) (5,0) (1,1) (4,1) (1,2)
    query (2,0)      1     1     1     .     .     .     .     .     .
    query (1,1)      1     1     .     .     .     .     1     .     .
    query (1,2)      1     1     .     .     .     .     1     .     1
    query (4,1)      .     .     .     .     1     .     .     1     .     (document 1 only)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Elements:
    """A flat list of (anchor, depth) elements."""

    anchor: torch.Tensor  # (E,) long
    depth: torch.Tensor  # (E,) long

    def __len__(self) -> int:
        return self.anchor.shape[0]

    @property
    def position(self) -> torch.Tensor:
        return self.anchor + self.depth

    def select(self, index: torch.Tensor) -> Elements:
        return Elements(self.anchor[index], self.depth[index])

    def to(self, device: torch.device) -> Elements:
        return Elements(self.anchor.to(device), self.depth.to(device))

    @staticmethod
    def cat(parts: list[Elements]) -> Elements:
        return Elements(torch.cat([p.anchor for p in parts]), torch.cat([p.depth for p in parts]))

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.anchor.tolist(), self.depth.tolist(), strict=True))


def attention_mask(query: Elements, key: Elements, doc_ids: torch.Tensor) -> torch.Tensor:
    """(Eq, Ek) bool: True where the query element may attend to the key element."""
    q_anchor, q_depth = query.anchor[:, None], query.depth[:, None]
    k_anchor, k_depth = key.anchor[None, :], key.depth[None, :]
    same_document = doc_ids[query.anchor][:, None] == doc_ids[key.anchor][None, :]
    key_is_context = k_depth == 0
    key_not_after_anchor = k_anchor <= q_anchor
    same_chain = k_anchor == q_anchor
    key_earlier_in_chain = k_depth <= q_depth
    return same_document & ((key_is_context & key_not_after_anchor) | (same_chain & key_earlier_in_chain))


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
