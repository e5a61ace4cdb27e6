"""Draft vocabulary and mask-token resolution."""

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from peagle_ray.drafter.vocab import MASK_TOKEN, MaskToken, count_tokens, draft_vocabulary, resolve_mask_token


def test_draft_vocabulary_worked_example():
    d2t, t2d = draft_vocabulary(torch.tensor([5, 0, 9, 1, 9, 2]), 3)
    assert d2t.tolist() == [0, 1, 2]  # target ids [0, 2, 4]
    assert t2d.tolist() == [True, False, True, False, True, False]


def test_draft_vocabulary_maps_draft_to_target_ids():
    counts = torch.tensor([0, 7, 0, 0, 3, 8, 1, 0, 2])
    d2t, t2d = draft_vocabulary(counts, 4)
    target_ids = torch.arange(4) + d2t
    assert target_ids.tolist() == [1, 4, 5, 8]
    assert t2d.nonzero().squeeze(1).tolist() == [1, 4, 5, 8]


def test_full_vocabulary_when_unset():
    d2t, t2d = draft_vocabulary(torch.tensor([3, 1, 2]), None)
    assert d2t.tolist() == [0, 0, 0] and t2d.all()


def test_count_tokens_counts_only_loss_masked_tokens():
    counts = count_tokens([(torch.tensor([1, 2, 2, 3]), torch.tensor([0, 1, 1, 0]))], vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 0, 0]


@pytest.fixture
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


def test_mask_token_order_of_preference(tokenizer):
    vocab = len(tokenizer) + 7
    assert resolve_mask_token(tokenizer, vocab, explicit=11).source == "explicit"
    chosen = resolve_mask_token(tokenizer, vocab)
    assert (chosen.id, chosen.source) == (tokenizer.mask_token_id, "tokenizer mask token '<|MASK|>'")


def test_mask_token_is_added_in_an_unused_row():
    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<pad>": 2}, unk_token="<pad>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>")
    chosen = resolve_mask_token(tokenizer, vocab_size=8)
    assert chosen == MaskToken(3, f"added {MASK_TOKEN} in unused embedding row")
    assert tokenizer.convert_ids_to_tokens(3) == MASK_TOKEN


def test_existing_mask_string_is_reused(tokenizer):
    tokenizer.mask_token = None
    chosen = resolve_mask_token(tokenizer, len(tokenizer) + 7)
    assert chosen == MaskToken(tokenizer.convert_tokens_to_ids(MASK_TOKEN), f"existing {MASK_TOKEN} token")


def test_mask_token_falls_back_to_pad_then_errors(tokenizer):
    tokenizer.mask_token = None
    full = len(tokenizer)
    chosen = resolve_mask_token(tokenizer, full)
    assert (chosen.id, chosen.source) == (tokenizer.pad_token_id, "tokenizer pad token")
    tokenizer.pad_token = tokenizer.eos_token = tokenizer.unk_token = None
    with pytest.raises(
        ValueError,
        match=r"no mask token could be chosen; tried drafter\.mask_token_id \(unset\), "
        r"the tokenizer's mask token \(none\), an unused embedding row .*"
        r"the unk token \(none\)\. Set drafter\.mask_token_id\.",
    ):
        resolve_mask_token(tokenizer, full)


def test_explicit_mask_token_out_of_range_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r"drafter\.mask_token_id must be in \[0, 100\); got 100"):
        resolve_mask_token(tokenizer, 100, explicit=100)


def test_a_run_started_from_a_drafter_keeps_its_draft_vocabulary(tmp_path):
    from safetensors.torch import save_file

    from peagle_ray.drafter.build import initial_vocabulary

    save_file({"d2t": torch.tensor([0, 1, 5]), "fc.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    d2t, t2d = initial_vocabulary(tmp_path, 8)  # draft ids 0, 1, 2 -> target ids 0, 2, 7
    assert d2t.tolist() == [0, 1, 5] and t2d.tolist() == [True, False, True, False, False, False, False, True]
    save_file({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    assert initial_vocabulary(tmp_path, 8) is None  # full vocabulary: the run's own choice stands
