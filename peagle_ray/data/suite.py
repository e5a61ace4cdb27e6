"""The built-in prompt suite: 320 prompts written for this project, 40 in each of 8 categories (coding,
math, qa, summarization, translation, writing, tool_calls, rag), shipped as JSONL in data/prompts/.

Each row has a fixed `id`, `category` and `split` (every fifth prompt of a category is validation), and
either a `prompt` or full `messages` (tool-call prompts carry a system message describing the tools).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources

from peagle_ray.data.prepare import Conversation, normalize_messages

CATEGORIES = ("coding", "math", "qa", "summarization", "translation", "writing", "tool_calls", "rag")


def builtin_conversations(categories: tuple[str, ...] = CATEGORIES) -> Iterator[Conversation]:
    folder = resources.files("peagle_ray.data") / "prompts"
    for category in categories:
        for line in (folder / f"{category}.jsonl").read_text().splitlines():
            row = json.loads(line)
            yield Conversation(row["id"], normalize_messages(row), row["category"], row["split"])
