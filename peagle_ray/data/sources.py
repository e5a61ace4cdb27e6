"""Where conversations come from: the entries of data.sources.

    "builtin"            the shipped prompt suite (data/suite.py)
    "sharegpt[:N]"       ShareGPT V3, N conversations sampled with data.seed (data/public.py; extra `data`)
    "magpie:N"           N user prompts written by the target itself from its chat template's user-turn
                         prefix alone (Magpie, arXiv 2406.08464), deduplicated and filtered
    PATH.jsonl / .json   OpenAI `messages`, ShareGPT `conversations` or `{"prompt": ...}` rows
    PATH.txt             one prompt per line
    DIRECTORY            a data set saved with `datasets.save_to_disk`

Bad rows are counted in `bad` by reason and skipped, never raised.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from peagle_ray.data.prepare import BadRow, BadRows, Conversation, normalize_messages, split_of
from peagle_ray.data.public import sharegpt_conversations
from peagle_ray.data.suite import builtin_conversations

# n -> n results: (prompt text, finished before the token limit), or None for a failed request
PromptWriter = Callable[[int], list[tuple[str, bool] | None]]


def source_count(source: str) -> int | None:
    """N of "name:N" (None for a bare "name"), e.g. source_count("sharegpt:500") -> 500."""
    _, sep, count = source.partition(":")
    return int(count) if sep else None


def is_magpie(source: str) -> bool:
    return source.startswith("magpie:")


def read_conversations(sources: list[str], validation_fraction: float, bad: BadRows, seed: int = 0,
                       write_prompts: PromptWriter | None = None) -> Iterator[Conversation]:  # fmt: skip
    """Every conversation of every source; bad rows go to `bad`. Magpie sources need `write_prompts`."""
    for source in sources:
        if source == "builtin":
            yield from builtin_conversations()
        elif source == "sharegpt" or source.startswith("sharegpt:"):
            yield from sharegpt_conversations(source_count(source), seed, validation_fraction, bad)
        elif is_magpie(source):
            if write_prompts is None:
                raise ValueError(f"data.sources entry {source!r} needs the target to write prompts; "
                                 "run it through `peagle-ray data prepare`, which starts the target")  # fmt: skip
            yield from magpie_conversations(source_count(source), write_prompts, validation_fraction, bad)
        else:
            yield from file_conversations(source, validation_fraction, bad)


def file_conversations(source: str, validation_fraction: float, bad: BadRows) -> Iterator[Conversation]:
    for row_id, row in _rows(source):
        try:
            if isinstance(row, BadRow):
                raise row
            messages = normalize_messages(row)
        except BadRow as err:
            bad.add(err.reason, row_id)
            continue
        sample_id = str(row.get("id", row_id))
        category = str(row.get("category", "user"))
        yield Conversation(sample_id, messages, category, split_of(sample_id, validation_fraction))


def _rows(source: str) -> Iterator[tuple[str, dict | BadRow]]:
    """(row id, parsed row or BadRow) for one non-builtin source."""
    path = Path(source)
    if path.is_dir():
        from datasets import load_from_disk

        for i, row in enumerate(load_from_disk(str(path))):
            yield f"{path.name}:{i}", row
    elif path.suffix == ".txt":
        for i, line in enumerate(path.read_text().splitlines()):
            yield f"{path.name}:{i}", {"prompt": line}
    elif path.suffix in (".jsonl", ".json"):
        with path.open() as f:
            for i, line in enumerate(f):
                if not line.strip():
                    yield f"{path.name}:{i}", BadRow("empty")
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    yield f"{path.name}:{i}", BadRow("invalid_json", str(err))
                    continue
                yield f"{path.name}:{i}", row if isinstance(row, dict) else BadRow("invalid_json", "not an object")
    else:
        raise ValueError(f"data.sources entries must be 'builtin', 'sharegpt[:N]', 'magpie:N', a .jsonl/.json/.txt "
                         f"file or a dataset directory; got {source!r}")


# ---- Magpie: prompts the target writes itself ---------------------------------------------------------

MAGPIE_SENTINEL = "\x00peagle-magpie\x00"


def magpie_prefix(tokenizer) -> list[int]:
    """The chat template's text up to where a user message's content starts (its default system prompt
    included), as token ids: the target completes it with a user prompt, e.g. ChatML
    "<|im_start|>user\\n"."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MAGPIE_SENTINEL}], tokenize=False)
    if MAGPIE_SENTINEL not in text:
        raise ValueError("the target's chat template does not render the user's content; Magpie needs it")
    return tokenizer(text[: text.index(MAGPIE_SENTINEL)], add_special_tokens=False)["input_ids"]


def magpie_rejection(text: str, finished: bool) -> str | None:
    """Why a written prompt is dropped (a BAD_ROW_REASONS name), or None to keep it.

    empty: nothing but whitespace; degenerate: cut off by the token limit, fewer than 3 words, or more than
    half of its word 3-grams repeated (e.g. "tell me tell me tell me tell me ...").
    """
    words = text.split()
    if not words:
        return "empty"
    if not finished or len(words) < 3:
        return "degenerate"
    trigrams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    if len(trigrams) >= 10 and len(set(trigrams)) < len(trigrams) / 2:
        return "degenerate"
    return None


def magpie_conversations(count: int, write_prompts: PromptWriter, validation_fraction: float, bad: BadRows,
                         batch_size: int = 32, max_attempts_factor: int = 4) -> Iterator[Conversation]:  # fmt: skip
    """`count` distinct user-only conversations (the answer is regenerated later), asking at most
    count x max_attempts_factor prompts; every dropped one is a bad row under its reason."""
    seen: set[str] = set()
    made = attempts = 0
    while made < count and attempts < count * max_attempts_factor:
        n = min(batch_size, count * max_attempts_factor - attempts)
        for result in write_prompts(n):
            attempts += 1
            row_id = f"magpie:#{attempts}"
            if result is None:
                bad.add("generation_failed", row_id)
                continue
            text = result[0].strip()
            reason = magpie_rejection(text, result[1])
            key = " ".join(text.lower().split())
            if reason is None and key in seen:
                reason = "duplicate"
            if reason is not None or made >= count:
                if reason is not None:
                    bad.add(reason, row_id)
                continue
            seen.add(key)
            made += 1
            sample_id = "magpie:" + hashlib.sha256(key.encode()).hexdigest()[:12]
            yield Conversation(sample_id, [{"role": "user", "content": text}], "magpie",
                               split_of(sample_id, validation_fraction))  # fmt: skip
    if made < count:
        print(f"[data] magpie: {made} of {count} prompts after {attempts} attempts (see bad rows)")
