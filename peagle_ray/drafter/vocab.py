"""Draft vocabulary (d2t / t2d) and the P-EAGLE mask token.

Draft vocabulary: the `size` most frequent target ids among loss-masked tokens, kept in ascending id order.
Draft id i stands for target id i + d2t[i]; t2d[v] says whether target id v has a draft id.
e.g. counts over V = 6 ids [5, 0, 9, 1, 9, 2], size 3 -> target ids [0, 2, 4] (ties broken by lower id),
d2t = [0, 1, 2], t2d = [1, 0, 1, 0, 1, 0].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK_TOKEN = "<|MASK|>"


def draft_vocabulary(counts: torch.Tensor, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t (DV,) long, t2d (V,) bool) from per-target-id token counts (V,); size None keeps all V ids."""
    vocab = counts.shape[0]
    if size is None or size >= vocab:
        return torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    if size <= 0:
        raise ValueError(f"draft_vocab_size must be positive; got {size}")
    order = torch.argsort(-counts.to(torch.float64), stable=True)  # most frequent first, ties by id
    target_ids = order[:size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids - torch.arange(size), t2d


def count_tokens(sequences, vocab_size: int) -> torch.Tensor:
    """Counts (V,) of the loss-masked token ids in (input_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in sequences:
        counts += torch.bincount(input_ids[loss_mask.bool()], minlength=vocab_size)
    return counts


@dataclass(frozen=True)
class MaskToken:
    id: int
    source: str  # how it was chosen, for logs and the provenance record


def resolve_mask_token(tokenizer, vocab_size: int, explicit: int | None = None) -> MaskToken:
    """explicit id -> tokenizer's mask token -> add MASK_TOKEN in an unused embedding row -> pad/eos/unk.

    Adding changes `tokenizer` in place (the new token gets id len(tokenizer)); save it with the drafter.
    """
    tried = []
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise ValueError(f"drafter.mask_token_id must be in [0, {vocab_size}); got {explicit}")
        return MaskToken(explicit, "explicit")
    tried.append("drafter.mask_token_id (unset)")
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id < vocab_size:
        return MaskToken(tokenizer.mask_token_id, f"tokenizer mask token {tokenizer.mask_token!r}")
    tried.append("the tokenizer's mask token (none)")
    if len(tokenizer) < vocab_size:
        before = len(tokenizer)
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
        added = tokenizer.mask_token_id >= before
        how = f"added {MASK_TOKEN} in unused embedding row" if added else f"existing {MASK_TOKEN} token"
        return MaskToken(tokenizer.mask_token_id, how)
    tried.append(f"an unused embedding row (len(tokenizer) = {len(tokenizer)} >= vocab_size = {vocab_size})")
    for name in ("pad", "eos", "unk"):
        token_id = getattr(tokenizer, f"{name}_token_id")
        if token_id is not None and token_id < vocab_size:
            return MaskToken(token_id, f"tokenizer {name} token")
        tried.append(f"the {name} token (none)")
    raise ValueError("no mask token could be chosen; tried " + ", ".join(tried) + ". Set drafter.mask_token_id.")
