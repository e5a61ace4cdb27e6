"""`peagle-ray bench train-memory`: peak memory and tokens/s of one training step, each configuration in a
fresh subprocess (so peaks do not mix), with and without sequence partitioning.

The drafter has the SmolLM2 shape (H=576, 1 layer, draft vocabulary 32768, float32); the sequence is N
positions of random hidden states, every position supervised, COD 0.7 / 0.2. tokens/s counts base
positions (N) per second of the second step (the first warms up). A configuration whose process passes
`memory_limit_gb` is stopped and reported as such rather than taking the machine down. `freeze_lm_head`
measures the step with the draft lm_head frozen (drafter.freeze_lm_head), as the reference trainer has it;
`bf16` under bfloat16 autocast (training.precision; CPUs with AMX run bf16 GEMMs ~4x faster than fp32).

Each row also carries `reference_tokens_per_s`: the speculators 0.9 P-EAGLE trainer (patched to run on CPU
with SDPA) on the same shape, as measured once on this machine kind (2 cores; issue 11) - quoted, not re-run
here (it is not a dependency) - and `vs_reference`, ours / that figure.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import torch

from peagle_ray.bench.shapes import bench_arch, random_drafter, random_sequence
from peagle_ray.config import DrafterConfig
from peagle_ray.train.elements import cod_sample
from peagle_ray.train.step import sequence_backward

UNPARTITIONED = 10**9  # a segment length no sequence reaches
# (N, K) -> base tokens/s of the speculators 0.9 trainer, SmolLM2 shape, DV 32768, fp32 (None: out of memory)
REFERENCE_TOKENS_PER_S = {
    (1024, 4): 364.0,
    (1024, 8): 278.0,
    (2048, 4): 329.0,
    (2048, 8): 174.0,
    (4096, 8): 114.0,
    (8192, 4): None,
    (8192, 8): None,
}


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
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20  # the GPU's peak, not the host's
    return {
        "seq_len": seq_len,
        "depths": depths,
        "partitioned": partitioned,
        "elements": stats.elements,
        "segments": stats.segments,
        "device": device.type,
        "peak_rss_mb": round(peak_mb, 1),
        "tokens_per_s": round(seq_len / timings[-1], 1),
        "step_s": round(timings[-1], 3),
    }


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
    seq_lens=(1024, 2048, 4096, 8192),
    depths=(4, 8),
    segment_length: int = 2048,
    draft_vocab_size: int = 32768,
    memory_limit_gb: float = 18.0,
    progress=print,
    freeze_lm_head: bool = False,
    bf16: bool = False,
) -> dict:
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
                row = {"seq_len": n, "depths": k, "partitioned": partitioned, **_run_child(args, memory_limit_gb)}
                reference = (
                    REFERENCE_TOKENS_PER_S.get((n, k), "not measured") if draft_vocab_size == 32768 else "not measured"
                )
                row["reference_tokens_per_s"] = reference
                if isinstance(reference, float) and row.get("tokens_per_s"):
                    row["vs_reference"] = round(row["tokens_per_s"] / reference, 3)
                progress(json.dumps(row))
                rows.append(row)
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
    n, k, part, seg, dv, frozen, bf16 = (int(a) for a in sys.argv[1:8])
    print(json.dumps(one_step(n, k, bool(part), seg, dv, bool(frozen), bool(bf16))))
