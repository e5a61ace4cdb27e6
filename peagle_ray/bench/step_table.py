"""`peagle-ray bench step-table`, the table scripts/gpu_check.sh makes on a lent GPU: one P-EAGLE training step
at the drafter shapes of real targets (Qwen3-8B, Llama-3.1-8B: hidden 4096, their full vocabularies, a draft
vocabulary of 32k, K = 8, bfloat16 autocast), ours with compiled flex attention and with SDPA, and the
reference trainer's (speculators 0.9) where it is installed, at N = 2048, 8192 and 32768.

Every (shape, trainer, attention) runs in a process of its own over all N, so a compile or an out-of-memory
at one N costs a row, not the table. Each row: tokens/s (N over the median of 5 steps' seconds, after 2
untimed ones that compile and warm up) and the spread of those 5 (slowest over fastest), peak memory
(torch.cuda.max_memory_allocated on CUDA; the process's peak RSS on CPU, where the `tiny` shape rehearses the
script), on CUDA the share of one more step, run under torch.profiler, that the GPU's kernels were busy, and
our dry run's estimate (train/plan.py) beside ours.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from typing import Annotated, Any

import torch

from peagle_ray.bench.shapes import shape_arch
from peagle_ray.config import PeagleConfig, with_values
from peagle_ray.drafter.model import Drafter, DrafterArch
from peagle_ray.drafter.teacher import Teacher
from peagle_ray.options import Opt


def step_config(depths: int, segment_length: int, bf16: bool) -> PeagleConfig:
    return with_values(
        PeagleConfig(),
        {
            "drafter.num_depths": depths,
            "training.segment_length": segment_length,
            "training.precision": "bfloat16" if bf16 else "float32",
            "training.use_gpu": torch.cuda.is_available(),
        },
    )


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


WARMUP_STEPS, TIMED_STEPS = 2, 5
"""Steps of each row: WARMUP_STEPS untimed (compiled flex attention compiles for the first shape, then once
more for dynamic shapes, as COD samples a new element count each step), then the median of TIMED_STEPS."""


def _timed(step, device: torch.device) -> dict[str, Any]:
    """`step` run WARMUP_STEPS times untimed, then TIMED_STEPS times: the median seconds, the spread (slowest
    over fastest, minus 1) and the last call's result; on CUDA, one more call under torch.profiler gives the
    share of its wall time the GPU's kernels were busy."""
    seconds, result = [], None
    for i in range(WARMUP_STEPS + TIMED_STEPS):
        start = time.perf_counter()
        result = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= WARMUP_STEPS:
            seconds.append(time.perf_counter() - start)
    seconds.sort()
    out = {"seconds": seconds[len(seconds) // 2], "spread": seconds[-1] / seconds[0] - 1, "result": result}
    if device.type == "cuda":
        out["gpu_busy"] = _gpu_busy_share(step)
    return out


def _gpu_busy_share(step) -> float:
    """The kernels' own device time over the wall time of one profiled call of `step` (as the profiler table's
    "Self CUDA time total" counts it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    return sum(e.self_device_time_total for e in kernels) / 1e6 / wall


def _measured(n: int, timed: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A row's measurements from _timed."""
    row = {
        "tokens_per_s": round(n / timed["seconds"], 1),
        "step_s": round(timed["seconds"], 4),
        "spread_pct": round(100 * timed["spread"], 1),
        "peak_gib": round(_peak_bytes(device) / 2**30, 2),
    }
    if "gpu_busy" in timed:
        row["gpu_busy_pct"] = round(100 * timed["gpu_busy"], 1)
    return row


def _random_sequence(arch: DrafterArch, n: int):
    """n positions of random inputs on the host (sequence_backward moves them), every position supervised."""
    from peagle_ray.train.elements import TrainSequence

    t = n + 1
    seq = TrainSequence.from_record(
        torch.randint(0, arch.vocab_size - 1, (t,)),
        torch.ones(t),
        torch.randn(t, arch.num_aux * arch.hidden_size),
        torch.randn(t, arch.hidden_size),
    )
    return TrainSequence(seq.tokens, seq.hidden, seq.teacher_hidden, torch.ones(n, dtype=torch.bool), seq.doc_ids)


def ours(shape: str, seq_lens: list[int], depths: int, draft_vocab_size: int, layers: int, segment_length: int,
         attention: str, bf16: bool) -> list[dict]:  # fmt: skip
    """In the child process: our step (drafter.frozen's default: the embedding frozen) at every N."""
    from peagle_ray.drafter.build import freeze
    from peagle_ray.train.plan import count_parameters, estimate_memory
    from peagle_ray.train.step import make_optimizer, sample_elements, sequence_backward

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arch = shape_arch(shape, depths, draft_vocab_size, layers)
    cfg = step_config(depths, segment_length, bf16)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: an 8B shape's embedding is 0.6-0.8B numbers
        drafter = Drafter(arch)
        for param in drafter.parameters():
            torch.nn.init.normal_(param, std=0.02)
        head = torch.randn(arch.draft_vocab_size, arch.hidden_size) * 0.02
        teacher = Teacher(torch.ones(arch.hidden_size), head, arch.rms_norm_eps)
    freeze(drafter, cfg.drafter.frozen)
    optimizer, _ = make_optimizer(drafter, cfg.training)
    trained, frozen, buffers = count_parameters(arch, cfg)
    g, rows = torch.Generator().manual_seed(0), []
    for n in seq_lens:
        row: dict[str, Any] = {"shape": shape, "trainer": "ours", "attention": attention, "seq_len": n}
        estimate = estimate_memory(arch, with_values(cfg, {"data.max_length": n}), n, segment_length, trained,
                                   frozen, buffers)  # fmt: skip
        row["estimate_gib"] = round(estimate.peak / 2**30, 2)
        try:
            seq = _random_sequence(arch, n)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()

            def step(seq=seq):
                elements = sample_elements(seq, cfg.drafter, g)
                optimizer.zero_grad(set_to_none=True)
                stats = sequence_backward(drafter, teacher, seq, elements, segment_length, None, bf16=bf16,
                                          use_flex=attention == "flex")  # fmt: skip
                optimizer.step()
                return stats

            timed = _timed(step, device)
            row.update(
                _measured(n, timed, device), elements=timed["result"].elements, segments=timed["result"].segments
            )
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        finally:
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def reference(shape: str, seq_lens: list[int], depths: int, draft_vocab_size: int, layers: int,
              bf16: bool) -> list[dict]:  # fmt: skip
    """In the child process: speculators 0.9's P-EAGLE step (its forward, COD and KL loss; flex attention and
    its fused loss on CUDA, SDPA and its eager loss on CPU) at every N."""
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    from peagle_ray.bench.peers import build_reference, reference_loss
    from peagle_ray.bench.train_memory import shape_target

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    arch = shape_arch(shape, depths, draft_vocab_size, layers)
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[: arch.draft_vocab_size] = True  # draft id i is target id i
    like = SimpleNamespace(arch=arch, d2t=torch.zeros(arch.draft_vocab_size, dtype=torch.long), t2d=t2d)
    with tempfile.TemporaryDirectory(prefix="peagle-shape-target-") as tmp:
        attention = "simple_flex_attention" if cuda else "sdpa"
        model = build_reference(Path(shape_target(arch, tmp)), like, [0, 1, 2], attention).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    cfg = step_config(depths, 10**9, bf16)
    rows = []
    for n in seq_lens:
        row: dict[str, Any] = {"shape": shape, "trainer": "reference", "attention": "flex" if cuda else "sdpa",
                               "seq_len": n}  # fmt: skip
        try:
            host = _random_sequence(arch, n)
            seq = type(host)(*(t.to(device) for t in (host.tokens, host.hidden, host.teacher_hidden,
                                                        host.supervised, host.doc_ids)))  # fmt: skip
            if cuda:
                torch.cuda.reset_peak_memory_stats()

            def step(seq=seq):
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                    loss, _ = reference_loss(model, seq, cfg, "fused" if cuda else "eager")
                loss.backward()
                optimizer.step()

            row.update(_measured(n, _timed(step, device), device))
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        finally:
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def _child(kind: str, args: dict, timeout_s: float) -> list[dict]:
    """Run ours / reference in a fresh process; its failure (or timeout) is one row that says so."""
    cmd = [sys.executable, "-m", "peagle_ray.bench.step_table", kind, json.dumps(args)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [{**_label(kind, args), "error": f"timed out after {timeout_s:g} s"}]
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
        return [{**_label(kind, args), "error": f"exit code {out.returncode}: {last}"}]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _label(kind: str, args: dict) -> dict:
    return {"shape": args["shape"], "trainer": kind, "attention": args.get("attention", "-"), "seq_len": "all"}


def run(
    shapes: Annotated[tuple[str, ...], Opt("Shapes (bench/shapes.py SHAPES): qwen3-8b, llama3.1-8b, tiny.")] = (
        "qwen3-8b",
        "llama3.1-8b",
    ),
    seq_lens: Annotated[tuple[int, ...], Opt("Positions per sequence.")] = (2048, 8192, 32768),
    depths: int = 8,
    draft_vocab_size: int = 32768,
    layers: Annotated[int, Opt("Drafter layers.")] = 1,
    segment_length: Annotated[int, Opt("Elements per partition segment.")] = 8192,
    bf16: bool = True,
    timeout_s: Annotated[float, Opt("Seconds each (shape, trainer, attention) process may run.")] = 300.0,
    progress=print,
) -> dict:
    """Every shape: ours with flex (CUDA only: its backward does not run on CPU) and SDPA, the reference."""
    from peagle_ray.bench.peers import reference_available

    attentions = ["flex", "sdpa"] if torch.cuda.is_available() else ["sdpa"]
    rows: list[dict] = []
    for shape in shapes:
        common = {"shape": shape, "seq_lens": list(seq_lens), "depths": depths,
                  "draft_vocab_size": draft_vocab_size, "layers": layers, "bf16": bf16}  # fmt: skip
        for attention in attentions:
            found = _child("ours", {**common, "attention": attention, "segment_length": segment_length}, timeout_s)
            rows += found
            progress(json.dumps(found))
        if reference_available():
            found = _child("reference", common, timeout_s)
        else:
            found = [{**_label("reference", common), "error": "speculators is not installed"}]
        rows += found
        progress(json.dumps(found))
    result = {"depths": depths, "draft_vocab_size": draft_vocab_size, "layers": layers, "segment_length": segment_length,
              "precision": "bfloat16" if bf16 else "float32", "device": _device_name(), "rows": rows}  # fmt: skip
    result["table"] = table(rows)
    return result


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def table(rows: list[dict]) -> str:
    lines = [
        "| shape | N | trainer | attention | tokens/s | step s (spread) | peak GiB | GPU busy | dry-run estimate GiB |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "tokens_per_s" in r:
            busy = f"{r['gpu_busy_pct']}%" if "gpu_busy_pct" in r else "-"
            measured = f"{r['tokens_per_s']:,.0f} | {r['step_s']} ({r['spread_pct']}%) | {r['peak_gib']} | {busy}"
        else:
            measured = f"{r['error']} | - | - | -"
        lines.append(
            f"| {r['shape']} | {r['seq_len']} | {r['trainer']} | {r['attention']} | {measured} | "
            f"{r.get('estimate_gib', '-')} |"
        )
    lines += [""] + ratios(rows)
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    """Ours (flex where measured, else SDPA) against the reference at each shape and N: the tokens/s ratio and
    the peak-memory ratio (issue 48's goals: >= 1.5x and <= 0.5x)."""
    measured = {(r["shape"], r["seq_len"], r["trainer"], r["attention"]): r for r in rows if "tokens_per_s" in r}
    lines = []
    for (shape, n, trainer, _), reference in measured.items():
        if trainer != "reference":
            continue
        ours = measured.get((shape, n, "ours", "flex")) or measured.get((shape, n, "ours", "sdpa"))
        if ours:
            lines.append(
                f"{shape} N={n}: ours ({ours['attention']}) / reference: "
                f"{ours['tokens_per_s'] / reference['tokens_per_s']:.2f}x tokens/s, "
                f"{ours['peak_gib'] / reference['peak_gib']:.2f}x peak memory"
            )
    return lines


if __name__ == "__main__":  # one (shape, trainer, attention) process of run(); `peagle-ray bench step-table` runs it
    found = (ours if sys.argv[1] == "ours" else reference)(**json.loads(sys.argv[2]))
    print(json.dumps(found))
