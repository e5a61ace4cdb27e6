"""Workloads: the prompts of one real task family, as the demo and `bench adapt` send them to the endpoint, and
their stable train / held-out split.

    humaneval        code completion: HumanEval's 164 function stubs as user turns (the `data` extra).
    builtin-CATEGORY one category of the built-in suite (40 prompts; e.g. builtin-coding).
    sharegpt-WORD    one task family from real chat traffic: ShareGPT first turns containing WORD (e.g.
                     sharegpt-email: "write an email ..."), prose with shared structure.
"""

from __future__ import annotations

import re

from peagle_ray.config import ConfigError
from peagle_ray.data.prepare import BadRows, split_of
from peagle_ray.data.public import EvalPrompt, humaneval_prompts, sharegpt_conversations
from peagle_ray.data.suite import CATEGORIES, builtin_conversations


def workload_prompts(name: str) -> list[EvalPrompt]:
    """The workload's prompts, in a stable order; an unknown name is refused, listing the known ones."""
    if name == "humaneval":
        return humaneval_prompts()
    if name.startswith("builtin-") and name[len("builtin-") :] in CATEGORIES:
        return [
            EvalPrompt(c.sample_id, name, [m for m in c.messages if m["role"] != "assistant"])
            for c in builtin_conversations((name[len("builtin-") :],))
        ]
    if name.startswith("sharegpt-") and len(name) > len("sharegpt-"):
        word = re.compile(rf"\b{re.escape(name.split('-', 1)[1])}\b", re.IGNORECASE)
        out = []
        for c in sharegpt_conversations(None, 0, 0.0, BadRows()):
            user = next(m["content"] for m in c.messages if m["role"] == "user")
            if word.search(user) and len(user) < 2000:
                out.append(EvalPrompt(c.sample_id, name, [{"role": "user", "content": user}]))
        return out
    raise ConfigError(
        "workload must be 'humaneval', 'sharegpt-WORD' (e.g. sharegpt-email) or 'builtin-CATEGORY' (one of "
        f"{', '.join(CATEGORIES)}); got {name!r}"
    )


def split_prompts(
    prompts: list[EvalPrompt], heldout_fraction: float, train_count: int, heldout_count: int
) -> tuple[list[EvalPrompt], list[EvalPrompt]]:
    """(train, held-out) by a stable hash of each prompt's id (data.prepare.split_of), capped at the counts."""
    train = [p for p in prompts if split_of(p.prompt_id, heldout_fraction) == "train"]
    heldout = [p for p in prompts if split_of(p.prompt_id, heldout_fraction) == "validation"]
    return train[:train_count], heldout[:heldout_count]
