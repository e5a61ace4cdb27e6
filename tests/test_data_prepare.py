"""Data preparation: formats, chat templating and loss masks, bad rows, the built-in suite."""

import json
from collections import Counter

import pytest
from transformers import AutoTokenizer

from peagle_ray.data.prepare import (
    BadRow,
    BadRows,
    Conversation,
    PreparedData,
    finish_sample,
    prepare_samples,
    read_prepared,
    read_token_counts,
    tokenize_conversation,
    write_prepared,
)
from peagle_ray.data.sources import read_conversations
from peagle_ray.data.suite import CATEGORIES, builtin_conversations


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


def test_loss_mask_covers_exactly_the_assistant_tokens(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you"},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages, max_length=1000)
    assert (
        ids == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    masked = [tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])]
    assert masked == ["Hello there<|im_end|>\nSee you<|im_end|>\n"]
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert unmasked == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


def test_truncation_and_over_length(tokenizer):
    messages = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok then"}]
    full, _ = tokenize_conversation(tokenizer, messages, 1000)
    ids, mask = tokenize_conversation(tokenizer, messages, len(full) - 2)
    assert len(ids) == len(full) - 2 and mask[-1] == 1
    with pytest.raises(BadRow, match="over_length"):
        tokenize_conversation(tokenizer, messages, 20)
    with pytest.raises(BadRow, match="empty_loss_mask"):
        finish_sample([1, 2, 3], [0, 0, 0], 10)


def test_a_template_that_rewrites_earlier_turns_is_reported(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(BadRow, match="template_not_prefix"):
        tokenize_conversation(tokenizer, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], 100)


def test_every_bad_row_kind_is_counted_and_skipped(tmp_path, tokenizer):
    rows = [
        '{"messages": [{"role": "user", "content": "fine"}, {"role": "assistant", "content": "yes"}]}',
        "{not json",
        "",
        '{"messages": []}',
        '{"messages": [{"role": "wizard", "content": "hi"}]}',
        '{"conversations": [{"from": "alien", "value": "hi"}]}',
        '{"messages": [{"role": "user", "content": "no answer here"}]}',
        json.dumps({"messages": [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "y"}]}),
        '{"text": "unknown shape"}',
        '{"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi!"}]}',
    ]
    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(rows) + "\n")
    bad = BadRows()
    samples = list(prepare_samples(read_conversations([str(source)], 0.0, bad), tokenizer, 64, bad))
    assert len(samples) == 2
    assert bad.counts == Counter(
        invalid_json=1, unknown_shape=1, empty=2, unknown_role=2, no_assistant_turn=1, over_length=1
    )
    assert bad.examples["unknown_role"] == [
        "chats.jsonl:4: messages[0].role = 'wizard'",
        "chats.jsonl:5: conversations[0].from = 'alien'",
    ]
    assert bad.report() == (
        "bad rows: 8 skipped (invalid_json 1, unknown_shape 1, unknown_role 2, empty 2, "
        "no_assistant_turn 1, over_length 1)"
    )


def test_txt_prompts_and_saved_datasets_are_read(tmp_path):
    from datasets import Dataset

    (tmp_path / "prompts.txt").write_text("first prompt\nsecond prompt\n")
    Dataset.from_list(
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    ).save_to_disk(str(tmp_path / "ds"))
    bad = BadRows()
    conversations = list(read_conversations([str(tmp_path / "prompts.txt"), str(tmp_path / "ds")], 0.5, bad))
    assert [c.messages[-1]["content"] for c in conversations] == ["first prompt", "second prompt", "a"]
    assert all(c.split in ("train", "validation") for c in conversations) and bad.total() == 0


def test_regenerated_turns_are_the_supervised_tokens(tokenizer, tmp_path):
    conversations = [
        Conversation("a", [{"role": "user", "content": "hi"}]),
        Conversation("b", [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "old"}]),
        Conversation("c", [{"role": "user", "content": "silent"}]),
    ]
    answers = {"a": [7, 8, 9], "b": [5, 6], "c": []}
    order = iter(["a", "b", "c"])
    bad = BadRows()
    samples = list(
        prepare_samples(
            conversations, tokenizer, 100, bad, regenerate=lambda prompts: [answers[next(order)] for _ in prompts]
        )
    )
    assert [s.sample_id for s in samples] == ["a", "b"]
    assert samples[0].input_ids[-3:] == [7, 8, 9] and samples[0].loss_mask[-4:] == [0, 1, 1, 1]
    assert "old" not in tokenizer.decode(samples[1].input_ids)  # the old answer was replaced
    assert bad.counts == Counter(no_assistant_turn=1)
    prepared = write_prepared(samples, tmp_path, len(tokenizer) + 7, bad)
    assert prepared.samples == {"train": 2} and prepared.bad_rows == {"no_assistant_turn": 1}
    assert prepared.by_category == {samples[0].category: {"train": 2}}
    assert PreparedData.read(tmp_path) == prepared and PreparedData.exists(tmp_path)
    assert not PreparedData.exists(tmp_path / "elsewhere")
    counts = read_token_counts(tmp_path)
    assert counts[7] == 1 and counts[5] == 1 and int(counts.sum()) == 5
    assert [s.sample_id for s in read_prepared(tmp_path, "train")] == ["a", "b"]


def test_builtin_suite_has_every_category_and_a_fixed_split():
    conversations = list(builtin_conversations())
    assert len(conversations) == 320
    by_category = Counter(c.category for c in conversations)
    assert set(by_category) == set(CATEGORIES) and set(by_category.values()) == {40}
    assert Counter(c.split for c in conversations) == Counter(train=256, validation=64)
    assert len({c.sample_id for c in conversations}) == 320
    tool = next(c for c in conversations if c.category == "tool_calls")
    assert tool.messages[0]["role"] == "system" and "get_weather" in tool.messages[0]["content"]
