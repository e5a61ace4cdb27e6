"""`peagle-ray bench train-memory`: peak memory and tokens/s of one training step, each configuration in a
fresh subprocess (so peaks do not mix), with and without sequence partitioning.

The drafter has the SmolLM2 shape (H=576, 1 layer, draft vocabulary 32768, float32); the sequence is N
positions of random hidden states, every position supervised, COD 0.7 / 0.2. tokens/s counts base
positions (N) per second of the second step (the first warms up). A configuration whose process passes
`memory_limit_gb` is stopped and reported as such rather than taking the machine down. `freeze_lm_head`
measures the step with the draft lm_head frozen (drafter.freeze_lm_head), as the reference trainer has it;
`bf16` under bfloat16 autocast (training.precision; CPUs with AMX run bf16 GEMMs ~4x faster than fp32).

With speculators installed (scripts/setup.sh does), every (N, K) also runs the speculators 0.9 P-EAGLE step (its
forward, COD sampling and KL loss, eager on CPU: HF SDPA attention and its eager loss) on the same shape and a
random target of that shape, in its own subprocess too: the row `trainer: "reference"`, and `vs_reference`
(ours / its tokens/s, and its peak / ours) on our partitioned row.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import torch

from peagle_ray.bench.shapes import bench_arch, random_drafter, random_sequence
from peagle_ray.config import DrafterConfig
from peagle_ray.options import Opt
from peagle_ray.train.elements import cod_sample
from peagle_ray.train.step import sequence_backward

UNPARTITIONED = 10**9  # a segment length no sequence reaches


def one_step(
    seq_len: int,
    depths: int,
    partitioned: bool,
    segment_length: int,
    draft_vocab_size: int,
    freeze_lm_head: bool = False,
    bf16: bool = False,
) -> dict:
    """Run in the child process: two steps, report the second's time and the process's peak RSS."""
    arch = bench_arch("peagle", depths, draft_vocab_size)
    drafter, teacher = random_drafter(arch)
    drafter.lm_head.weight.requires_grad_(not freeze_lm_head)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CUDA: compiled flex attention
    drafter, teacher = drafter.to(device), teacher.to(device)
    g = torch.Generator().manual_seed(0)
    seq = random_sequence(arch, seq_len, g)
    cfg = DrafterConfig(num_depths=depths)
    timings = []
    for _ in range(2):
        elements = cod_sample(seq.supervised, seq.doc_ids, depths, cfg.cod_keep_ratio, cfg.cod_min_ratio, g)
        drafter.zero_grad(set_to_none=True)
        start = time.perf_counter()
        stats = sequence_backward(
            drafter, teacher, seq, elements, segment_length if partitioned else UNPARTITIONED, None, bf16=bf16
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    return {
        "seq_len": seq_len,
        "depths": depths,
        "partitioned": partitioned,
        "elements": stats.elements,
        "segments": stats.segments,
        **_timing(device, seq_len, timings[-1]),
    }


def _timing(device: torch.device, seq_len: int, seconds: float) -> dict:
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20  # the GPU's peak, not the host's
    return {
        "device": device.type,
        "peak_rss_mb": round(peak_mb, 1),
        "tokens_per_s": round(seq_len / seconds, 1),
        "step_s": round(seconds, 3),
    }


def reference_step(seq_len: int, depths: int, draft_vocab_size: int) -> dict:
    """Run in the child process: two speculators 0.9 P-EAGLE steps on the bench shape (its draft lm_head is
    frozen, as it trains), report the second's time and the peak RSS."""
    import tempfile

    from peagle_ray.bench.peers import build_reference, reference_loss
    from peagle_ray.config import build_config

    arch = bench_arch("peagle", depths, draft_vocab_size)
    drafter, _ = random_drafter(arch)
    drafter.t2d.zero_()
    drafter.t2d[: arch.draft_vocab_size] = True  # draft id i is target id i (d2t all zero)
    with tempfile.TemporaryDirectory(prefix="peagle-shape-target-") as tmp:
        model = build_reference(Path(shape_target(arch, tmp)), drafter, [0, 1, 2])
    cfg = build_config({"drafter": {"num_depths": depths}})
    seq = random_sequence(arch, seq_len, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    timings = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss, metrics = reference_loss(model, seq, cfg)
        loss.backward()
        timings.append(time.perf_counter() - start)
    elements = sum(int(metrics[f"position_{d}_acc_total"]) for d in range(depths))
    return {
        "seq_len": seq_len,
        "depths": depths,
        "trained_elements": elements,
        **_timing(torch.device("cpu"), seq_len, timings[-1]),
    }


def shape_target(arch, directory: str) -> str:
    """A Llama target directory of `arch`'s shape with random embeddings and final norm (what the reference
    reads from its verifier): config.json and model.safetensors."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=4,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=True,
    ).save_pretrained(directory)
    g = torch.Generator().manual_seed(1)
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(arch.vocab_size, arch.hidden_size, generator=g) * 0.02,
            "model.norm.weight": torch.ones(arch.hidden_size),
        },
        f"{directory}/model.safetensors",
    )
    return directory


def _run_child(args: list[str], memory_limit_gb: float) -> dict:
    import psutil

    cmd = [sys.executable, "-m", "peagle_ray.bench.train_memory", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            rss = child.memory_info().rss
        except psutil.NoSuchProcess:
            break
        peak = max(peak, rss)
        if rss > memory_limit_gb * 2**30:
            proc.kill()
            proc.wait()
            return {"error": f"exceeded the {memory_limit_gb:g} GB memory limit", "peak_rss_mb": round(peak / 2**20, 1)}
        time.sleep(0.1)
    out, err = proc.communicate()
    if proc.returncode != 0:
        return {"error": f"exit code {proc.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}"}
    return json.loads(out.strip().splitlines()[-1])


def run(
    seq_lens: Annotated[tuple[int, ...], Opt("Positions per sequence.")] = (1024, 2048, 4096, 8192),
    depths: Annotated[tuple[int, ...], Opt("K values.")] = (4, 8),
    segment_length: Annotated[int, Opt("Elements per partition segment.")] = 2048,
    draft_vocab_size: Annotated[int, Opt("Draft vocabulary.")] = 32768,
    memory_limit_gb: Annotated[float, Opt("Stop a configuration past this RSS.")] = 18.0,
    progress=print,
    freeze_lm_head: Annotated[bool, Opt("Measure with the draft lm_head frozen.")] = False,
    bf16: Annotated[bool, Opt("Under bfloat16 autocast (training.precision).")] = False,
    reference: bool | None = None,
) -> dict:
    """Every (N, K): ours partitioned and not, and the reference (default: when speculators is installed)."""
    from peagle_ray.bench.peers import reference_available

    reference = reference_available() if reference is None else reference
    rows = []
    for n in seq_lens:
        for k in depths:
            for partitioned in (True, False):
                args = [
                    str(n),
                    str(k),
                    str(int(partitioned)),
                    str(segment_length),
                    str(draft_vocab_size),
                    str(int(freeze_lm_head)),
                    str(int(bf16)),
                ]
                row: dict[str, Any] = {"seq_len": n, "depths": k, "trainer": "ours", "partitioned": partitioned}
                row.update(_run_child(args, memory_limit_gb))
                progress(json.dumps(row))
                rows.append(row)
                if partitioned:
                    ours = row  # vs_reference goes on our partitioned row
            if reference:
                ref = {"seq_len": n, "depths": k, "trainer": "reference"}
                ref.update(_run_child(["reference", str(n), str(k), str(draft_vocab_size)], memory_limit_gb))
                progress(json.dumps(ref))
                if ref.get("tokens_per_s") and ours.get("tokens_per_s"):
                    ours["vs_reference"] = {
                        "tokens_per_s": round(ours["tokens_per_s"] / ref["tokens_per_s"], 3),
                        "peak_rss": round(ref["peak_rss_mb"] / ours["peak_rss_mb"], 3),
                    }
                rows.append(ref)
    return {
        "hidden_size": 576,
        "layers": 1,
        "draft_vocab_size": draft_vocab_size,
        "segment_length": segment_length,
        "freeze_lm_head": freeze_lm_head,
        "precision": "bfloat16" if bf16 else "float32",
        "rows": rows,
    }


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        print(json.dumps(reference_step(*(int(a) for a in sys.argv[2:5]))))
    else:
        n, k, part, seg, dv, frozen, bf16 = (int(a) for a in sys.argv[1:8])
        print(json.dumps(one_step(n, k, bool(part), seg, dv, bool(frozen), bool(bf16))))
