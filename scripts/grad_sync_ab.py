"""Gradient sync of the training step, A/B: the Ray Train job's hand-written flat all-reduce after the step's
backward passes (train/worker.py all_reduce_mean) against torch DDP, what ray.train.torch.prepare_model wraps
the model in, syncing only on the step's last segment backward (no_sync before it, as gradient accumulation
over segments needs). Two CPU processes (gloo, one thread each), a SmolLM2-shaped P-EAGLE drafter with the
job's default frozen embedding, the same sequences, COD samples and step (sequence_backward) on both sides.
Appends one JSON line per run to OUT: the median step seconds of each (the first step of each run warms up;
each variant runs twice, interleaved) and the largest gradient difference between them.

    .venv/bin/python scripts/grad_sync_ab.py N K SEGMENT_LENGTH STEPS SEQUENCES_PER_STEP OUT.jsonl
"""

import json
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from peagle_ray.bench.shapes import bench_arch, random_drafter, random_sequence  # noqa: E402
from peagle_ray.config import DrafterConfig  # noqa: E402
from peagle_ray.train.elements import cod_sample  # noqa: E402
from peagle_ray.train.partition import balanced_boundaries, partition  # noqa: E402
from peagle_ray.train.step import sequence_backward, trained_elements  # noqa: E402
from peagle_ray.train.worker import all_reduce_mean  # noqa: E402


class Elementwise(torch.nn.Module):
    """The drafter with forward_elements as its forward, so DDP's forward (and its reducer) sees each segment."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args):
        return self.drafter.forward_elements(*args)


def forward_calls(batch, elements, segment: int, k: int) -> int:
    """How many segment forwards (and backwards) sequence_backward makes over the batch: segments with trained
    elements."""
    total = 0
    for seq, elems in zip(batch, elements, strict=True):
        trained = trained_elements(elems, seq)
        segments = partition(elems, seq.doc_ids, balanced_boundaries(elems, seq.num_positions, segment))
        index_of = torch.full((seq.num_positions * k,), -1, dtype=torch.long)
        index_of[elems.anchor * k + elems.depth] = torch.arange(len(elems))
        total += sum(bool(trained[index_of[s.own.anchor * k + s.own.depth]].any()) for s in segments)
    return total


def allreduce_step(drafter, teacher, batch, elements, segment, params, world) -> None:
    for seq, elems in zip(batch, elements, strict=True):
        sequence_backward(drafter, teacher, seq, elems, segment, None, scale=1 / len(batch))
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_mean([p.grad for p in params], world)


def ddp_step(ddp, drafter, teacher, batch, elements, segment, k) -> None:
    total, calls = forward_calls(batch, elements, segment, k), [0]

    def via_ddp(*args):
        calls[0] += 1
        ddp.require_backward_grad_sync = calls[0] == total  # = no_sync() for every backward but the last
        return ddp(*args)

    proxy = types.SimpleNamespace(
        arch=drafter.arch,
        embed_tokens=drafter.embed_tokens,
        norm=drafter.norm,
        lm_head=drafter.lm_head,
        forward_elements=via_ddp,
    )
    for seq, elems in zip(batch, elements, strict=True):
        sequence_backward(proxy, teacher, seq, elems, segment, None, scale=1 / len(batch))
    assert calls[0] == total


def run(rank, world, n, k, segment, steps, sequences, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    arch = bench_arch("peagle", k, 32768)
    cod = DrafterConfig(num_depths=k)
    seconds: dict[str, list[float]] = {}
    grads = {}
    for variant in ("allreduce", "ddp", "allreduce", "ddp"):
        drafter, teacher = random_drafter(arch, seed=0)
        drafter.embed_tokens.weight.requires_grad_(False)  # the job's default (drafter.frozen)
        params = [p for p in drafter.parameters() if p.requires_grad]
        g = torch.Generator().manual_seed(100 + rank)
        batch = [random_sequence(arch, n, g) for _ in range(sequences)]
        ddp = torch.nn.parallel.DistributedDataParallel(Elementwise(drafter)) if variant == "ddp" else None
        for step in range(steps):
            eg = torch.Generator().manual_seed(7 + step)
            elements = [
                cod_sample(s.supervised, s.doc_ids, k, cod.cod_keep_ratio, cod.cod_min_ratio, eg) for s in batch
            ]
            drafter.zero_grad(set_to_none=True)
            started = time.perf_counter()
            if ddp is None:
                allreduce_step(drafter, teacher, batch, elements, segment, params, world)
            else:
                ddp_step(ddp, drafter, teacher, batch, elements, segment, k)
            if step:  # the first step warms up
                seconds.setdefault(variant, []).append(time.perf_counter() - started)
        grads[variant] = torch.cat([p.grad.reshape(-1) for p in params]).clone()
    if rank == 0:
        median = {v: statistics.median(t) for v, t in seconds.items()}
        row = {
            "n": n,
            "k": k,
            "segment_length": segment,
            "sequences_per_step": sequences,
            "workers": world,
            "trainable_parameters": sum(p.numel() for p in params),
            "median_step_s": {v: round(m, 3) for v, m in median.items()},
            "steps_timed": {v: len(t) for v, t in seconds.items()},
            "ddp_over_allreduce": round(median["ddp"] / median["allreduce"], 3),
            "max_grad_diff": float((grads["allreduce"] - grads["ddp"]).abs().max()),
            "max_grad": float(grads["allreduce"].abs().max()),
        }
        print("RESULT " + json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    n, k, segment, steps, sequences = (int(x) for x in sys.argv[1:6])
    mp.spawn(run, args=(2, n, k, segment, steps, sequences, sys.argv[6]), nprocs=2)
