"""Where one training step's time goes on a GPU: torch.profiler over one P-EAGLE step at a real drafter shape
(bench/step_table.py's), after untimed warm-up steps. For a lent GPU machine (device tool, with gpu_wheels/):
    PYTHONPATH=. python3 scripts/gpu_profile_step.py --shape qwen3-8b --seq-len 8192 --attention flex --out DIR
Writes DIR/profile_<attention>.txt: the ops by self CPU time and by self CUDA time, the step's wall time, and
the share of it the GPU was busy. On the CPU it runs the `tiny` shape with SDPA (a rehearsal)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--segment-length", type=int, default=8192)
    parser.add_argument("--attention", choices=("flex", "sdpa"), default="flex")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("gpu-out"))
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from peagle_ray.bench.step_table import _random_sequence, shape_arch, step_config
    from peagle_ray.drafter.build import freeze
    from peagle_ray.drafter.model import Drafter
    from peagle_ray.drafter.teacher import Teacher
    from peagle_ray.train.step import make_optimizer, sample_elements, sequence_backward

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    arch = shape_arch(args.shape, 8, 32768, 1)
    cfg = step_config(8, args.segment_length, True)
    with torch.device(device):
        drafter = Drafter(arch)
        for param in drafter.parameters():
            torch.nn.init.normal_(param, std=0.02)
        teacher = Teacher(torch.ones(arch.hidden_size), torch.randn(arch.draft_vocab_size, arch.hidden_size) * 0.02,
                          arch.rms_norm_eps)  # fmt: skip
    freeze(drafter, cfg.drafter.frozen)
    optimizer, _ = make_optimizer(drafter, cfg.training)
    seq, g = _random_sequence(arch, args.seq_len), torch.Generator().manual_seed(0)

    def step() -> None:
        elements = sample_elements(seq, cfg.drafter, g)
        optimizer.zero_grad(set_to_none=True)
        sequence_backward(drafter, teacher, seq, elements, args.segment_length, None, bf16=True,
                          use_flex=args.attention == "flex")  # fmt: skip
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    lines = [f"{args.shape} N={args.seq_len} {args.attention}: step {wall:.3f} s under the profiler"]
    if cuda:
        from torch.autograd import DeviceType

        # the kernels' own time (device events), as the table's "Self CUDA time total" counts it
        kernels = [
            e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        lines.append(f"GPU busy {busy:.3f} s = {busy / wall:.0%} of the step")
        lines.append(events.table(sort_by="self_device_time_total", row_limit=15))
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=25))
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines)
    (args.out / f"profile_{args.attention}.txt").write_text(text)
    print(text[:6000])


if __name__ == "__main__":
    main()
