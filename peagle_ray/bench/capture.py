"""`peagle-ray bench capture`: hidden-state capture throughput vs plain vLLM prefill, same token sequences.

Sequences: the built-in suite's prompts rendered with the target's chat template, concatenated and cut into
`num_sequences` sequences of `seq_len` tokens. 'prefill' is a plain vLLM engine (no capture) doing a
1-token generation over them, in its own process; 'capture' is the full pipeline: Ray Data actors ->
Ray Serve-hosted engine with extract_hidden_states -> validated records. Each is timed over --repeats passes
(default 3) after a small warm-up, the median counting. Per replica count: tokens/s over the whole pass and after its
first record (the pipeline's start: Ray Data's actors, the Serve handle), where a request's time went (the
engine, the replica reading the connector's file, Serve and the object store, Ray Data), and the hidden-state
bytes per token on the wire. Offline bytes per token are measured by writing the records as shards.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from peagle_ray.capture.stage import TIMING_COLUMNS
from peagle_ray.config import ConfigError, PeagleConfig
from peagle_ray.engine import engine_args, target_engine_env, use_local_cores
from peagle_ray.options import Opt

if TYPE_CHECKING:
    from peagle_ray.capture.pipeline import Record

REPEATS = 3  # default timed passes of plain prefill and of capture; the median counts (a pass varies up to 2x here)


def bench_sequences(target_dir: Path, num_sequences: int, seq_len: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from peagle_ray.data.prepare import render
    from peagle_ray.data.suite import builtin_conversations

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stream: list[int] = []
    for conversation in builtin_conversations():
        stream += render(tokenizer, conversation.messages, add_generation_prompt=True)
        if len(stream) >= num_sequences * seq_len:
            break
    if len(stream) < num_sequences * seq_len:
        raise ValueError(f"the built-in suite has {len(stream)} tokens; {num_sequences} x {seq_len} asked")
    return [stream[i * seq_len : (i + 1) * seq_len] for i in range(num_sequences)]


def _prefill_child(args_file: str, sequences_file: str, repeats: str) -> None:
    use_local_cores()
    from vllm import LLM, SamplingParams

    sequences = json.loads(Path(sequences_file).read_text())
    llm = LLM(**json.loads(Path(args_file).read_text()))
    prompts = [{"prompt_token_ids": s} for s in sequences]
    llm.generate(prompts[:4], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    seconds = []
    for _ in range(int(repeats)):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    print("RESULT " + json.dumps({"seconds": sorted(seconds)[len(seconds) // 2]}))


class StageTimes:
    """Sums of the capture rows' timing columns (stage.TIMING_COLUMNS), and when the first row arrived."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(TIMING_COLUMNS, 0.0)
        self.start, self.first_row_s = time.perf_counter(), 0.0

    def tap(self, rows: Iterable[dict]) -> Iterator[dict]:
        for row in rows:
            self.first_row_s = self.first_row_s or time.perf_counter() - self.start
            for key in TIMING_COLUMNS:
                self.sums[key] += float(row[key])
            yield row


def _capture_pass(session, samples: list, batch_size: int, actors: int, desc: str) -> tuple[list[Record], dict, Any]:
    """Records, the measured row (tokens/s and where the time went) and bad rows of one pass over `samples`.
    per_request_ms sums the rows' timings over the requests: with actors > 1 batches overlap, so the parts add
    up to more than the wall time."""
    from peagle_ray.capture.pipeline import capture_dataset, iter_records
    from peagle_ray.data.prepare import BadRows

    bad, times = BadRows(), StageTimes()
    ds = capture_dataset(samples, session.num_layers_captured, session.info.hidden_size, batch_size, actors)
    records = list(iter_records(times.tap(ds.iter_rows()), bad, total=len(samples), desc=desc))
    seconds = time.perf_counter() - times.start
    tokens, n = sum(len(s.input_ids) for s in samples), len(samples)
    ms = lambda total: round(1000 * total / n, 2)  # noqa: E731  per request
    sums = times.sums
    row = {
        "tokens_per_s": round(tokens / seconds, 1),
        "first_record_s": round(times.first_row_s, 2),
        "tokens_per_s_after_first": round(tokens * (n - 1) / n / max(seconds - times.first_row_s, 1e-9), 1),
        "per_request_ms": {
            "engine": ms(sums["engine_s"]),
            "replica_read": ms(sums["read_s"]),
            "serve_and_transfer": ms(sums["capture_s"] - sums["engine_s"] - sums["read_s"]),
            "ray_data_and_start": ms(seconds - sums["capture_s"]),
        },
        "wire_bytes_per_token": round(sums["wire_bytes"] / tokens, 1),
    }
    return records, row, bad


def _capture_rate(
    cfg: PeagleConfig, samples: list, replicas: int, actors: int, repeats: int
) -> tuple[list[Record], dict, Any]:
    """The median of `repeats` passes through `replicas` target replicas after a small warm-up, as plain prefill's:
    its row (with every pass's tokens/s) and bad rows, and the records of the last pass."""
    from peagle_ray.capture.pipeline import capture_dataset, iter_records
    from peagle_ray.capture.run import target_session
    from peagle_ray.config import with_values
    from peagle_ray.data.prepare import BadRows

    cfg = with_values(cfg, {"capture.num_replicas": replicas, "capture.num_actors": actors})
    with target_session(cfg) as session:
        layers, hidden = session.num_layers_captured, session.info.hidden_size
        warm = capture_dataset(samples[: 4 * replicas], layers, hidden, 4, actors)  # every replica warms up
        list(iter_records(warm.iter_rows(), BadRows(), desc=f"warm-up ({replicas} replicas)"))
        passes = []
        for i in range(repeats):  # every pass captures the same records: only the last pass's are kept
            desc = f"capture ({replicas} replicas, {i + 1})"
            records, row, bad = _capture_pass(session, samples, cfg.capture.batch_size, actors, desc)
            passes.append((row, bad))
    row, bad = sorted(passes, key=lambda p: p[0]["tokens_per_s"])[len(passes) // 2]
    passes_tok_s = [p[0]["tokens_per_s"] for p in passes]
    return records, {"replicas": replicas, "actors": actors, **row, "passes_tokens_per_s": passes_tok_s}, bad


def run(
    cfg: PeagleConfig,
    num_sequences: Annotated[int, Opt("Sequences captured.", flag="--sequences")] = 64,
    seq_len: Annotated[int, Opt("Tokens per sequence.")] = 256,
    replicas: Annotated[tuple[int, ...], Opt("Target replica counts measured, e.g. 1 2.")] = (1,),
    repeats: Annotated[int, Opt("Timed passes of prefill and of each replica count; the median counts.")] = REPEATS,
) -> dict:
    """Plain prefill once, then the capture pipeline for each replica count (capture.num_actors raised to at
    least the replica count; capture.max_replicas_per_node places them)."""
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1; got {repeats}")
    from peagle_ray.capture.pipeline import write_offline
    from peagle_ray.data.prepare import TokenizedSample
    from peagle_ray.target import resolve_target_path

    target_dir = resolve_target_path(cfg)
    sequences = bench_sequences(target_dir, num_sequences, seq_len)
    tokens = num_sequences * seq_len
    with tempfile.TemporaryDirectory() as tmp:
        seq_file = Path(tmp) / "sequences.json"
        seq_file.write_text(json.dumps(sequences))
        args_file = Path(tmp) / "engine_args.json"
        args_file.write_text(json.dumps(engine_args(cfg, target_dir, cfg.capture.num_gpus > 0)))
        cmd = [sys.executable, "-m", "peagle_ray.bench.capture", str(args_file), str(seq_file), str(repeats)]
        child = subprocess.run(
            cmd, capture_output=True, text=True, env=target_engine_env(cfg.target, on_gpu=cfg.capture.num_gpus > 0)
        )
        if child.returncode != 0:
            raise RuntimeError(f"prefill benchmark failed: {child.stderr[-2000:]}")
        result = next(line for line in child.stdout.splitlines() if line.startswith("RESULT "))
        prefill_s = json.loads(result.removeprefix("RESULT "))["seconds"]

        samples = [TokenizedSample(f"bench-{i}", "bench", "train", s, [1] * len(s)) for i, s in enumerate(sequences)]
        rows, bad_rows = [], {}
        for n in replicas:
            records, row, bad = _capture_rate(cfg, samples, n, max(n, cfg.capture.num_actors), repeats)
            rows.append(row)
            bad_rows.update(bad.counts)
        shard_dir = Path(tmp) / "shards"
        write_offline(records, shard_dir, cfg.capture.shard_size)
        shard_bytes = sum(p.stat().st_size for p in shard_dir.glob("*.safetensors"))
    first = rows[0]["tokens_per_s"]
    for row in rows:
        row["over_first"] = round(row["tokens_per_s"] / first, 3)
    return {
        "target": str(target_dir),
        "sequences": num_sequences,
        "seq_len": seq_len,
        "capture_tokens_per_s": first,
        "prefill_tokens_per_s": round(tokens / prefill_s, 1),
        "capture_over_prefill": round(first / (tokens / prefill_s), 3),
        "by_replicas": rows,
        "bytes_per_token_offline": round(shard_bytes / tokens, 1),
        "bad_rows": bad_rows,
        "capture_batch_size": cfg.capture.batch_size,
        "max_replicas_per_node": cfg.capture.max_replicas_per_node,
    }


if __name__ == "__main__":
    _prefill_child(*sys.argv[1:4])
