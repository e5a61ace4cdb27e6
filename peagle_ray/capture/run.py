"""Library entry points behind `peagle-ray data prepare|capture` and jobs/prepare_data.py, jobs/capture.py.

The target is started in Ray Serve for the run and stopped afterwards (also on errors and Ctrl-C); one
target session serves both response regeneration and capture.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from peagle_ray.capture.pipeline import capture_dataset, done_sample_ids, iter_records, write_offline
from peagle_ray.capture.target_server import start_target_server, stop_target_server
from peagle_ray.cluster import ensure_ray
from peagle_ray.config import PeagleConfig
from peagle_ray.data.prepare import (
    BadRows,
    TokenizedSample,
    prepare_samples,
    read_prepared,
    read_summary,
    write_prepared,
)
from peagle_ray.data.sources import PromptWriter, check_sources, is_magpie, magpie_prefix, read_conversations
from peagle_ray.target import TargetInfo, read_target_info, resolve_target_path


@dataclass
class TargetSession:
    handle: object  # Serve handle of TargetServer
    info: TargetInfo
    num_layers_captured: int  # aux layers + the last layer


@contextmanager
def target_session(cfg: PeagleConfig) -> Iterator[TargetSession]:
    info = read_target_info(resolve_target_path(cfg))
    ensure_ray()
    print(f"[capture] starting the target in Ray Serve: {info.path} (first start takes ~30-60 s on CPU)")
    handle = start_target_server(cfg, info.path, info.num_layers)
    aux = info.aux_layer_ids(cfg.capture.aux_layer_ids)
    try:
        yield TargetSession(handle, info, len(aux) + 1)
    finally:
        stop_target_server()


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


def run_prepare(cfg: PeagleConfig, session: TargetSession | None) -> dict:
    """Conversations -> data.output_dir/{train,validation}.jsonl, token counts, summary.json."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    target = resolve_target_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=cfg.target.trust_remote_code)
    bad = BadRows()
    if cfg.data.regenerate and session is None:
        raise ValueError("data.regenerate is true but no target session was given")
    regenerate = regenerator(session.handle, cfg) if cfg.data.regenerate and session is not None else None
    magpie = any(is_magpie(s) for s in cfg.data.sources)
    writer = prompt_writer(session.handle, cfg, tokenizer) if magpie and session is not None else None
    conversations = read_conversations(
        cfg.data.sources, cfg.data.validation_fraction, bad, cfg.data.seed, writer, cfg.data.max_row_bytes
    )
    samples = prepare_samples(
        conversations, tokenizer, cfg.data.max_length, bad, regenerate, cfg.data.regenerate_batch_size
    )
    with tqdm(desc="prepare", unit="sample") as bar:
        summary = write_prepared(samples, Path(cfg.data.output_dir), read_target_info(target).vocab_size, bad, bar)
    print(f"[data] {summary['samples']} samples, {summary['tokens']} tokens -> {cfg.data.output_dir}; {bad.report()}")
    if bad.total():
        print(f"[data] examples of skipped rows (all in summary.json):\n{bad.report_examples()}")
    return summary


def prepared_samples(cfg: PeagleConfig) -> list[TokenizedSample]:
    out = Path(cfg.data.output_dir)
    if read_summary(out) is None:
        raise FileNotFoundError(f"no prepared data in data.output_dir = {out}; run `peagle-ray data prepare` first")
    return read_prepared(out, "train") + read_prepared(out, "validation")


def samples_to_capture(cfg: PeagleConfig) -> tuple[list, set]:
    """(prepared samples not yet in capture.output_dir, sample ids already there)."""
    done = done_sample_ids(Path(cfg.capture.output_dir))
    return [s for s in prepared_samples(cfg) if s.sample_id not in done], done


def run_capture_offline(cfg: PeagleConfig, session: TargetSession) -> dict:
    """Capture every prepared sample not yet in capture.output_dir into safetensors shards."""
    out = Path(cfg.capture.output_dir)
    todo, done = samples_to_capture(cfg)
    print(f"[capture] {len(todo)} samples to capture ({len(done)} already in {out})")
    bad, start, written = BadRows(), time.monotonic(), 0
    if todo:
        ds = capture_dataset(
            todo, session.num_layers_captured, session.info.hidden_size, cfg.capture.batch_size, cfg.capture.num_actors
        )
        written = write_offline(iter_records(ds.iter_rows(), bad, total=len(todo)), out, cfg.capture.shard_size)
    summary = {
        "captured": written,
        "skipped_done": len(done),
        "bad_rows": dict(bad.counts),
        "seconds": round(time.monotonic() - start, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "capture_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[capture] {written} records written to {out}; {bad.report()}")
    return summary


def prepare_and_capture(cfg: PeagleConfig, prepare: bool, capture: bool) -> dict:
    """The data half of the pipeline in one target session: prepare (regenerating if configured), capture."""
    summary = {}
    if prepare:
        check_sources(cfg.data.sources)  # before the target starts
    needs_target = capture or cfg.data.regenerate or any(is_magpie(s) for s in cfg.data.sources)
    if prepare and not needs_target:
        return {"prepare": run_prepare(cfg, None)}
    with target_session(cfg) as session:
        if prepare:
            summary["prepare"] = run_prepare(cfg, session)
        if capture:
            summary["capture"] = run_capture_offline(cfg, session)
    return summary
