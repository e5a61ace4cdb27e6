"""The data stage behind `peagle-ray data prepare` and jobs/prepare_data.py: conversations in, a prepared
directory out (PreparedData). Answers are regenerated, and Magpie prompts written, by the running target
when the config asks for it; capture/run.py starts one target session for this stage and capture.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from peagle_ray.config import PeagleConfig
from peagle_ray.data.prepare import BadRows, PreparedData, prepare_samples, write_prepared
from peagle_ray.data.sources import PromptWriter, is_magpie, magpie_prefix, read_conversations
from peagle_ray.target import drafter_target, read_target_info


def needs_target(cfg: PeagleConfig) -> bool:
    """Whether preparing cfg's data asks the target for text (regenerated answers, Magpie prompts)."""
    return cfg.data.regenerate or any(is_magpie(s) for s in cfg.data.sources)


def run(cfg: PeagleConfig, target: Any = None) -> PreparedData:
    """`peagle-ray data prepare`: conversations (data.sources) in, training-ready token sequences out.

    Regenerates responses with the target (data.regenerate), applies the chat template and assistant loss
    masks; writes data.output_dir/{train,validation}.jsonl, token_counts.safetensors and summary.json (bad
    rows counted by reason and skipped).

    `target` is the Serve handle of the running target (capture.run.target_session), needed only to
    regenerate answers or write Magpie prompts."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    target_dir = drafter_target(cfg).path  # a target no drafter can be trained for is refused before any work
    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=cfg.target.trust_remote_code)
    bad = BadRows()
    if needs_target(cfg) and target is None:
        raise ValueError("data.regenerate is true or a source is Magpie, but no running target was given")
    regenerate = regenerator(target, cfg) if cfg.data.regenerate else None
    magpie = any(is_magpie(s) for s in cfg.data.sources)
    writer = prompt_writer(target, cfg, tokenizer) if magpie else None
    conversations = read_conversations(
        cfg.data.sources, cfg.data.validation_fraction, bad, cfg.data.seed, writer, cfg.data.max_row_bytes
    )
    samples = prepare_samples(
        conversations, tokenizer, cfg.data.max_length, bad, regenerate, cfg.data.regenerate_batch_size
    )
    with tqdm(desc="prepare", unit="sample") as bar:
        prepared = write_prepared(samples, Path(cfg.data.output_dir), read_target_info(target_dir).vocab_size, bad, bar)
    print(f"[data] {prepared.samples} samples, {prepared.tokens} tokens -> {cfg.data.output_dir}; {bad.report()}")
    if bad.total():
        print(f"[data] examples of skipped rows (all in summary.json):\n{bad.report_examples()}")
    return prepared


def regenerator(handle, cfg: PeagleConfig) -> Callable[[list[list[int]]], list[list[int] | None]]:
    """Send a batch of prompts to the target at once (vLLM batches them); return the generated ids."""

    asked = [0]  # requests sent so far: each has its own seed, data.seed + its number

    def regenerate(prompts: list[list[int]]) -> list[list[int] | None]:
        room = cfg.target.max_model_len  # prompt + answer must fit the engine's context
        first, asked[0] = asked[0], asked[0] + len(prompts)
        responses = [
            handle.generate.remote(
                p, min(cfg.data.max_new_tokens, room - len(p)), cfg.data.temperature, cfg.data.seed + first + i
            )
            for i, p in enumerate(prompts)
        ]
        return [_result_or_none(r) for r in responses]

    return regenerate


def prompt_writer(handle, cfg: PeagleConfig, tokenizer) -> PromptWriter:
    """Magpie: the target completes its chat template's user-turn prefix, n requests at a time, each with its
    own seed (data.seed + request number; a rerun matches only up to vLLM's batch-dependent numerics, which
    move sampled text); returns (decoded prompt, stopped before the limit)."""
    prefix, limit, asked = magpie_prefix(tokenizer), cfg.data.magpie_max_tokens, [0]

    def write(n: int) -> list[tuple[str, bool] | None]:
        seeds = [cfg.data.seed + asked[0] + i for i in range(n)]
        asked[0] += n
        responses = [handle.generate.remote(prefix, limit, cfg.data.magpie_temperature, s) for s in seeds]
        written = [_result_or_none(r) for r in responses]
        return [
            None
            if ids is None
            else (
                tokenizer.decode(ids, skip_special_tokens=True),
                len(ids) < limit or ids[-1] == tokenizer.eos_token_id,
            )
            for ids in written
        ]

    return write


def _result_or_none(response):
    """A failed request is one bad row (counted by the caller), not a failed run."""
    try:
        return response.result()
    except Exception as err:  # noqa: BLE001
        print(f"[data] regeneration failed: {repr(err)[:200]}")
        return None
