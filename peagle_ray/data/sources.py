"""Where conversations come from: the entries of data.sources.

    "builtin"            the shipped prompt suite (data/suite.py)
    "sharegpt[:N]"       ShareGPT V3, N conversations sampled with data.seed (data/public.py; extra `data`)
    "magpie:N"           N user prompts written by the target itself from its chat template's user-turn
                         prefix alone (Magpie, arXiv 2406.08464), deduplicated and filtered
    PATH.jsonl / .json   OpenAI `messages`, ShareGPT `conversations` or `{"prompt": ...}` rows
    PATH.txt             one prompt per line
    DIRECTORY            a data set saved with `datasets.save_to_disk`
    "traffic:DIR"        traffic the endpoint recorded (serving.record_dir), split by request (data/traffic.py)

Bad rows are counted in `bad` by reason and skipped, never raised.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from peagle_ray.config import ConfigError
from peagle_ray.data.prepare import BadRow, BadRows, Conversation, normalize_messages, split_of
from peagle_ray.data.public import json_array_items, sharegpt_conversations
from peagle_ray.data.suite import builtin_conversations
from peagle_ray.data.traffic import check_traffic_source, is_traffic, traffic_conversations

FILE_SUFFIXES = (".jsonl", ".json", ".txt")

# n -> n results: (prompt text, finished before the token limit), or None for a failed request
PromptWriter = Callable[[int], list[tuple[str, bool] | None]]


def source_count(source: str) -> int | None:
    """N of "name:N" (None for a bare "name"), e.g. source_count("sharegpt:500") -> 500."""
    _, sep, count = source.partition(":")
    return int(count) if sep else None


def is_magpie(source: str) -> bool:
    return source.startswith("magpie:")


def read_conversations(
    sources: list[str],
    validation_fraction: float,
    bad: BadRows,
    seed: int = 0,
    write_prompts: PromptWriter | None = None,
    max_row_bytes: int | None = None,
) -> Iterator[Conversation]:
    """Every conversation of every source; bad rows go to `bad`. Magpie sources need `write_prompts`."""
    check_sources(sources)
    for source in sources:
        if source == "builtin":
            yield from builtin_conversations()
        elif source == "sharegpt" or source.startswith("sharegpt:"):
            yield from sharegpt_conversations(source_count(source), seed, validation_fraction, bad)
        elif is_magpie(source):
            if write_prompts is None:
                raise ValueError(
                    f"data.sources entry {source!r} needs the target to write prompts; "
                    "run it through `peagle-ray data prepare`, which starts the target"
                )
            yield from magpie_conversations(source_count(source) or 0, write_prompts, validation_fraction, bad)
        elif is_traffic(source):
            yield from traffic_conversations(source, validation_fraction, bad, max_row_bytes)
        else:
            yield from file_conversations(source, validation_fraction, bad, max_row_bytes)


def check_sources(sources: list[str]) -> None:
    """Fail before any work on a data.sources entry that names no readable file or data set directory."""
    for source in sources:
        if source in ("builtin", "sharegpt") or source.startswith(("sharegpt:", "magpie:")):
            continue
        if is_traffic(source):
            check_traffic_source(source)
            continue
        path = Path(source)
        expected = "a .jsonl/.json/.txt file or a directory saved with `datasets.save_to_disk`"
        if path.is_dir():
            if not (path / "dataset_info.json").is_file() and not (path / "dataset_dict.json").is_file():
                raise ConfigError(
                    f"data.sources entry {source!r} is a directory but not a saved data set "
                    f"(no dataset_info.json); expected {expected}"
                )
        elif not path.exists():
            raise FileNotFoundError(
                f"data.sources entry {source!r} does not exist; expected 'builtin', "
                f"'sharegpt[:N]', 'magpie:N', 'traffic:DIR' or {expected}"
            )
        elif path.suffix not in FILE_SUFFIXES:
            raise ConfigError(f"data.sources entry {source!r} has suffix {path.suffix!r}; expected {expected}")
        elif not os.access(path, os.R_OK):
            raise PermissionError(f"data.sources entry {source!r} is not readable")


def file_conversations(
    source: str, validation_fraction: float, bad: BadRows, max_row_bytes: int | None = None
) -> Iterator[Conversation]:
    for row_id, row in _rows(source, max_row_bytes, bad):
        try:
            if isinstance(row, BadRow):
                raise row
            messages = normalize_messages(row)
            size = sum(len(m["content"].encode("utf-8", "replace")) for m in messages)
            if max_row_bytes is not None and size > max_row_bytes:
                raise BadRow("too_large", f"{size} bytes of text > data.max_row_bytes {max_row_bytes}")
        except BadRow as err:
            bad.skip(err, row_id)
            continue
        sample_id = str(row.get("id", row_id))
        category = str(row.get("category", "user"))
        yield Conversation(sample_id, messages, category, split_of(sample_id, validation_fraction))


def _rows(source: str, max_row_bytes: int | None, bad: BadRows) -> Iterator[tuple[str, Any]]:
    """(row id, parsed row or BadRow) for one file or data set directory."""
    path = Path(source)
    if path.is_dir():
        from datasets import load_from_disk

        for i, row in enumerate(load_from_disk(str(path))):
            yield f"{path.name}:{i}", row
    elif path.suffix == ".json" and _starts_with(path, b"["):
        for i, row in enumerate(json_array_items(path, bad)):  # one JSON array (ShareGPT's own files)
            yield f"{path.name}:{i}", row
    else:
        with path.open("rb") as f:
            for i, raw in enumerate(f):
                yield f"{path.name}:{i}", _parse_line(raw, path.suffix, max_row_bytes)


def _parse_line(raw: bytes, suffix: str, max_row_bytes: int | None) -> object:
    """One line of a .jsonl/.json (a JSON object) or .txt (a prompt) file, or the BadRow saying why not."""
    if max_row_bytes is not None and len(raw) > max_row_bytes:
        return BadRow("too_large", f"{len(raw)} bytes > data.max_row_bytes {max_row_bytes}")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return BadRow("invalid_utf8", str(err))
    if suffix == ".txt":
        return {"prompt": line.rstrip("\r\n")}
    if not line.strip():
        return BadRow("empty", "blank line")
    try:
        return json.loads(line)
    except (json.JSONDecodeError, RecursionError) as err:
        return BadRow("invalid_json", str(err)[:200])


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip().startswith(prefix)


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


def magpie_conversations(
    count: int,
    write_prompts: PromptWriter,
    validation_fraction: float,
    bad: BadRows,
    batch_size: int = 32,
    max_attempts_factor: int = 4,
) -> Iterator[Conversation]:
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
            yield Conversation(
                sample_id, [{"role": "user", "content": text}], "magpie", split_of(sample_id, validation_fraction)
            )
    if made < count:
        print(f"[data] magpie: {made} of {count} prompts after {attempts} attempts (see bad rows)")
