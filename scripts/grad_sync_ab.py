"""Gradient sync of the training step, A/B: a hand-written flat all-reduce after the step's backward passes
(what the Ray Train job did before it moved to the library) against torch DDP, what ray.train.torch.prepare_model
wraps the job's SegmentLoss in, syncing only on the step's last segment backward (no_sync before it, as
gradient accumulation over segments needs; the job's own path: sequence_backward with loss_module and sync). Two CPU processes (gloo, one thread each), a SmolLM2-shaped P-EAGLE drafter with the
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from peagle_ray.bench.shapes import bench_arch, random_drafter, random_sequence  # noqa: E402
from peagle_ray.config import DrafterConfig  # noqa: E402
from peagle_ray.train.elements import cod_sample  # noqa: E402
from peagle_ray.train.step import SegmentLoss, sequence_backward  # noqa: E402


def all_reduce_mean(tensors: list[torch.Tensor], world: int) -> None:
    """The mean of each tensor over the workers, in place: one flat all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def allreduce_step(drafter, teacher, batch, elements, segment, params, world) -> None:
    for seq, elems in zip(batch, elements, strict=True):
        sequence_backward(drafter, teacher, seq, elems, segment, None, scale=1 / len(batch))
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_mean([p.grad for p in params], world)


def ddp_step(ddp, drafter, teacher, batch, elements, segment) -> None:
    for n, (seq, elems) in enumerate(zip(batch, elements, strict=True)):
        last = n == len(batch) - 1
        sequence_backward(drafter, teacher, seq, elems, segment, None, scale=1 / len(batch), loss_module=ddp, sync=last)


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
        wrapped = SegmentLoss(drafter)
        options = {"find_unused_parameters": True, "forward_sync_buffers": False}  # the job's (train/worker.py)
        ddp = torch.nn.parallel.DistributedDataParallel(wrapped, **options) if variant == "ddp" else None
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
                ddp_step(ddp, drafter, teacher, batch, elements, segment)
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
