"""Malformed input never stops `peagle-ray data prepare`: a generated table of bad rows, each kind at each
nesting level, goes through the real CLI; every bad row is counted under the reason that names what was
wrong, and every good row is kept."""

import json
import subprocess
import sys
from collections import Counter

import pytest
from transformers import AutoTokenizer

from peagle_ray.data.prepare import BAD_ROW_REASONS, BadRow, normalize_messages, tokenize_conversation

USER = {"role": "user", "content": "hello there"}
ANSWER = {"role": "assistant", "content": "hi, how can I help?"}
WRONG_TYPES = [[], ["a list"], 7, 2.5, True, {"an": "object"}]


def _good(i: int) -> dict:
    return {"id": f"good-{i}", "messages": [USER, {"role": "assistant", "content": f"answer number {i}"}]}


def bad_row_table() -> list[tuple[object, str]]:
    """(row, expected reason): every kind of damage at every level of a row."""
    table: list[tuple[object, str]] = []
    # the row itself
    table += [(value, "not_an_object") for value in (["a", "list"], "a string", 3, None, True)]
    table += [({"text": "no known key"}, "unknown_shape"), ({}, "unknown_shape")]
    # the list of turns: OpenAI and ShareGPT shapes
    for key in ("messages", "conversations"):
        table += [({key: value}, "wrong_type") for value in ("a string", 7, {"role": "user"}, True)]
        table += [({key: None}, "missing_field"), ({key: []}, "empty")]
    table += [({"prompt": value}, "wrong_type") for value in (7, {"a": 1}, ["not", "text parts"])]
    table += [({"prompt": None}, "missing_field"), ({"prompt": "   "}, "empty")]
    # one turn
    for value in ("a string", 7, None, ["x"]):
        table.append(({"messages": [USER, value]}, "wrong_type"))
    table.append(({"conversations": [{"from": "human", "value": "q"}, "not a turn"]}, "wrong_type"))
    # a turn's role and content: missing, null, wrong type, unknown, empty
    for turn, reason in (
        [
            ({"content": "no role"}, "missing_field"),
            ({"role": None, "content": "null role"}, "missing_field"),
            ({"role": "user"}, "missing_field"),
            ({"role": "user", "content": None}, "missing_field"),
            ({"role": "nobody", "content": "who?"}, "unknown_role"),
            ({"role": "USER", "content": "shouting"}, "unknown_role"),
            ({"role": "user", "content": ""}, "empty_turn"),
            ({"role": "user", "content": " \n\t "}, "empty_turn"),
            ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "wrong_type"),
        ]
        + [({"role": value, "content": "x"}, "wrong_type") for value in WRONG_TYPES if value != []]
        + [({"role": "user", "content": value}, "wrong_type") for value in WRONG_TYPES if value != []]
    ):
        table.append(({"messages": [USER, turn, ANSWER]}, reason))
    for turn, reason in [
        ({"value": "no from"}, "missing_field"),
        ({"from": "human"}, "missing_field"),
        ({"from": "human", "value": 3}, "wrong_type"),
        ({"from": "bing", "value": "x"}, "unknown_role"),
        ({"from": 1, "value": "x"}, "wrong_type"),
    ]:
        table.append(({"conversations": [turn, {"from": "gpt", "value": "answer"}]}, reason))
    # tool-call shapes
    table += [
        ({"messages": [USER, {"role": "tool", "content": "42"}, ANSWER]}, "tool_call"),
        ({"messages": [USER, {"role": "function", "name": "f", "content": "42"}, ANSWER]}, "tool_call"),
        (
            {
                "messages": [
                    USER,
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
                ]
            },
            "tool_call",
        ),
        ({"messages": [USER, {"role": "assistant", "content": None, "function_call": {"name": "f"}}]}, "tool_call"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function", "value": "{}"}]}, "tool_call"),
    ]
    # conversation order
    table += [
        ({"messages": [ANSWER]}, "assistant_first"),
        ({"messages": [ANSWER, USER, ANSWER]}, "assistant_first"),
        ({"messages": [{"role": "system", "content": "be nice"}, ANSWER, USER]}, "assistant_first"),
        ({"messages": [{"role": "system", "content": "only me"}]}, "no_user_turn"),
        ({"messages": [USER]}, "no_assistant_turn"),
        ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": " "}]}, "empty"),
    ]
    # size
    table.append(({"messages": [{"role": "user", "content": "x" * (1 << 20)}, ANSWER]}, "too_large"))
    return table


LINE_DAMAGE = [
    (b"{not json", "invalid_json"),
    (b'{"messages": [', "invalid_json"),
    (b"", "empty"),
    (b'{"prompt": "caf\xe9 \xff"}', "invalid_utf8"),
    (b"[" * 100_000, "invalid_json"),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


def test_each_bad_row_raises_its_named_reason_and_nothing_else(tokenizer):
    table = bad_row_table()
    assert {reason for _, reason in table} <= set(BAD_ROW_REASONS)
    for row, reason in table:
        with pytest.raises(BadRow) as err:
            messages = normalize_messages(row)
            if reason != "too_large":  # the size limit is the reader's (data.max_row_bytes)
                tokenize_conversation(tokenizer, messages, max_length=64)
            else:
                raise BadRow("too_large")
        assert err.value.reason == reason, (row if len(repr(row)) < 300 else repr(row)[:300], err.value)


def test_text_parts_and_a_leading_system_turn_are_good_rows(tokenizer):
    row = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
            ANSWER,
        ]
    }
    assert normalize_messages(row)[1] == {"role": "user", "content": "hello"}
    ids, mask = tokenize_conversation(tokenizer, normalize_messages(row), 256)
    assert any(mask)


@pytest.mark.slow
def test_data_prepare_cli_skips_every_bad_row_and_keeps_every_good_one(tmp_path, tiny_target):
    from datasets import Dataset

    table = bad_row_table()
    lines: list[bytes] = []
    expected: Counter = Counter()
    good = 0
    for i, (row, reason) in enumerate(table):  # a good row between bad ones: nothing valid is lost
        lines.append(json.dumps(row).encode())
        expected[reason] += 1
        if i % 3 == 0:
            lines.append(json.dumps(_good(good)).encode())
            good += 1
    for raw, reason in LINE_DAMAGE:
        lines.append(raw)
        expected[reason] += 1
    (tmp_path / "chats.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "prompts.txt").write_bytes(b"a fine prompt\n\xff\xfe broken bytes\n\n")  # no answers: regenerate off
    expected.update(no_assistant_turn=1, invalid_utf8=1, empty=1)
    Dataset.from_list(
        [
            {"messages": [USER, ANSWER]},
            {"messages": None},
            {"messages": [USER, {"role": "assistant", "content": None}]},
            {"messages": [{"role": None, "content": "x"}, ANSWER]},
        ]
    ).save_to_disk(str(tmp_path / "ds"))
    expected.update(missing_field=3)
    good += 1
    out = tmp_path / "prepared"
    sources = json.dumps([str(tmp_path / "chats.jsonl"), str(tmp_path / "prompts.txt"), str(tmp_path / "ds")])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "peagle_ray.cli",
            "data",
            "prepare",
            "--set",
            f"target.path={tiny_target}",
            "--set",
            f"data.sources={sources}",
            "--set",
            "data.regenerate=false",
            "--set",
            f"data.output_dir={out}",
            "--set",
            "data.max_length=64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert sum(summary["samples"].values()) == good
    assert Counter(summary["bad_rows"]) == expected
    assert "examples of skipped rows" in result.stdout and "messages[1].role = 'nobody'" in result.stdout
    kept = [
        json.loads(line)["sample_id"]
        for split in ("train", "validation")
        if (out / f"{split}.jsonl").exists()
        for line in (out / f"{split}.jsonl").read_text().splitlines()
    ]
    assert sorted(k for k in kept if k.startswith("good-")) == sorted(f"good-{i}" for i in range(good - 1))


@pytest.mark.parametrize(
    "source, message",
    [
        ("/no/such/file.jsonl", "data.sources entry '/no/such/file.jsonl' does not exist"),
        ("{tmp}/notes.csv", "has suffix '.csv'; expected a .jsonl/.json/.txt file"),
        ("{tmp}", "is a directory but not a saved data set"),
    ],
)
@pytest.mark.slow
def test_a_source_that_cannot_be_read_fails_before_any_work(tmp_path, source, message):
    (tmp_path / "notes.csv").write_text("a,b\n")
    source = source.format(tmp=tmp_path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "peagle_ray.cli",
            "data",
            "prepare",
            "--set",
            f"data.sources={json.dumps([source])}",
            "--set",
            f"data.output_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
