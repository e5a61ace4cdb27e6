"""`peagle-ray bench train`: base tokens/s and peak memory per worker of the real training job (Ray Train,
gradient all-reduce, MLflow) for 1 and 2 workers, on the drafter the config builds for its target
(SmolLM2-135M by default).

The records are synthetic: `seq_len` random token ids of the target's vocabulary with random hidden states
of the target's shape, every position supervised (timing and memory do not depend on the values). Each
worker count trains `steps` steps of one sequence per worker, the cluster's CPUs split evenly between the
workers (training.cpus_per_worker; Ray sets each worker's torch threads to it); tokens/s is the median over the steps after
the first (warm-up) of the job's own `train/tokens_per_s` (all workers' positions / the slowest worker's
step time) and peak memory the job's `train/peak_memory_mb` (largest worker RSS), both read back from
MLflow.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated

import torch
from safetensors.torch import save_file

from peagle_ray.config import PeagleConfig
from peagle_ray.options import Opt
from peagle_ray.target import read_target_info


def synthetic_inputs(work: Path, target_dir: Path, aux_layers: int, records: int, seq_len: int, seed: int = 0) -> None:
    """work/data (prepared-data summary + token counts) and work/hidden (offline shards + manifest)."""
    from peagle_ray.capture.pipeline import Record, write_offline
    from peagle_ray.data.prepare import TOKEN_COUNTS, PreparedData

    info = read_target_info(target_dir)
    g = torch.Generator().manual_seed(seed)

    def record(i: int, split: str, length: int) -> Record:
        loss_mask = torch.ones(length, dtype=torch.int8)
        loss_mask[:2] = 0
        return Record(
            sample_id=f"bench-{i}",
            split=split,
            input_ids=torch.randint(0, info.vocab_size, (length,), generator=g),
            loss_mask=loss_mask,
            aux_hidden=torch.randn(length, aux_layers * info.hidden_size, generator=g),
            last_hidden=torch.randn(length, info.hidden_size, generator=g),
        )

    rows = [record(i, "train", seq_len) for i in range(records)] + [record(records, "validation", 128)]
    write_offline(rows, work / "hidden", shard_size=8)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    counts = torch.ones(info.vocab_size, dtype=torch.long)  # uniform: the draft vocabulary is any top-DV
    save_file({"counts": counts}, str(data / TOKEN_COUNTS))
    samples = {"train": records, "validation": 1}
    PreparedData(data, samples, {"bench": samples}, records * seq_len + 128, {}, {}).write_summary()


def run(
    cfg: PeagleConfig,
    workers: Annotated[tuple[int, ...], Opt("Worker counts measured.")] = (1, 2),
    steps: Annotated[int, Opt("Steps per worker count (the first is warm-up).")] = 6,
    seq_len: Annotated[int, Opt("Positions per training sequence.")] = 1024,
    progress=print,
) -> dict:
    import ray

    from peagle_ray.cluster import ensure_ray
    from peagle_ray.target import resolve_target_path

    ensure_ray()
    target_dir = resolve_target_path(cfg)
    aux = len(read_target_info(target_dir).aux_layer_ids(cfg.capture.aux_layer_ids))
    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else os.cpu_count() or 1
    results = []
    with tempfile.TemporaryDirectory(prefix="peagle-bench-train-") as tmp:
        work = Path(tmp)
        synthetic_inputs(work, target_dir, aux, steps * max(workers), seq_len)
        for n in workers:
            progress(f"[bench train] {n} worker(s): {steps} steps of {seq_len} positions per worker")
            results.append(one_worker_count(cfg, work, n, max(1, cpus // n), steps))
            progress(f"[bench train] {n} worker(s): {results[-1]}")
    by_workers = {r["workers"]: r for r in results}
    scaling = (by_workers[2]["tokens_per_s"] / by_workers[1]["tokens_per_s"]) if {1, 2} <= by_workers.keys() else None
    return {
        "benchmark": "train",
        "target": str(target_dir),
        "algorithm": cfg.drafter.algorithm,
        "num_depths": cfg.drafter.num_depths,
        "draft_vocab_size": cfg.drafter.draft_vocab_size,
        "num_layers": cfg.drafter.num_layers,
        "seq_len": seq_len,
        "steps": steps,
        "segment_length": cfg.training.segment_length,
        "precision": cfg.training.precision,
        "results": results,
        "two_worker_speedup": None if scaling is None else round(scaling, 2),
    }


def one_worker_count(cfg: PeagleConfig, work: Path, workers: int, cpus_per_worker: int, steps: int) -> dict:
    """The real training job on the synthetic inputs in `work` with `workers` workers; its MLflow metrics."""
    from peagle_ray.config import with_values
    from peagle_ray.tracking import metric_history
    from peagle_ray.train.job import run_training

    uri = f"sqlite:///{work / 'mlflow.db'}"
    run_cfg = with_values(
        cfg,
        {
            "capture.mode": "offline",
            "capture.output_dir": str(work / "hidden"),
            "data.output_dir": str(work / "data"),
            "training.num_workers": workers,
            "training.max_steps": steps,
            "training.validate_every": steps,
            "training.sequences_per_step": 1,
            "training.log_every": 1,
            "training.cpus_per_worker": cpus_per_worker,
            "training.storage_path": str(work / "runs"),
            "training.run_name": f"bench-{workers}-workers",
            "tracking.tracking_uri": uri,
            "tracking.registered_model": None,
        },
    )
    started = time.perf_counter()
    summary = run_training(run_cfg)
    wall = time.perf_counter() - started
    history = lambda name: [v for _, v in metric_history(uri, summary.run_id, name)]  # noqa: E731
    speed = history("train/tokens_per_s")[1:] or history("train/tokens_per_s")  # the first step warms up
    tokens_per_s = statistics.median(speed)
    return {
        "workers": workers,
        "cpus_per_worker": cpus_per_worker,
        "tokens_per_s": round(tokens_per_s, 1),
        "tokens_per_s_per_worker": round(tokens_per_s / workers, 1),
        "peak_memory_mb_per_worker": round(max(history("train/peak_memory_mb")), 1),
        "elements_per_step_per_worker": statistics.median(history("train/elements")),
        "job_wall_s": round(wall, 1),
    }
