"""`peagle-ray bench draft-latency`: median time of one draft proposal, K = 1..8, both algorithms.

A decode step after a 256-token context: one new position (the token the target just sampled) plus the
draft. P-EAGLE drafts K tokens in one forward, so its time should stay flat in K; EAGLE-3 runs K forwards.
Measured in bfloat16 (how drafters are served on GPUs; this CPU has AVX512-BF16) and float32. In float32
the K-row lm_head product (K x 576 x 32768) is compute-bound on 2 cores and grows with K; in bfloat16 it
stays memory-bound and flat.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Annotated, get_args

import torch

from peagle_ray.bench.shapes import bench_arch, random_drafter
from peagle_ray.drafter.model import Algorithm, DraftCache
from peagle_ray.options import Opt


def proposal_ms(
    algorithm: Algorithm,
    k: int,
    draft_vocab_size: int | None,
    context: int,
    repeats: int,
    target: Path | None,
    dtype: torch.dtype,
    num_layers: int = 1,
) -> float:
    arch = bench_arch(algorithm, k, draft_vocab_size, num_layers, target)
    drafter, _ = random_drafter(arch)
    drafter.to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size - 1, (context + repeats + 3,), generator=g)
    hidden = torch.randn(context + repeats + 3, arch.num_aux * arch.hidden_size, generator=g).to(dtype)
    cache = DraftCache(arch.num_layers)
    drafter.propose(cache, tokens[:context], hidden[:context], k)  # prefill
    times = []
    for i in range(repeats + 3):
        p = context + i
        start = time.perf_counter()
        drafter.propose(cache, tokens[p : p + 1], hidden[p : p + 1], k)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[3:])  # first calls warm up allocators


def run(
    draft_vocab_size: Annotated[int | None, Opt("Draft vocabulary (0 = the full target vocabulary).")] = 32768,
    max_k: Annotated[int, Opt("Largest K measured.")] = 8,
    context: Annotated[int, Opt("Positions already in the drafter's KV cache.")] = 256,
    repeats: Annotated[int, Opt("Proposals timed per K.")] = 30,
    target: Annotated[Path | None, Opt("Take the drafter's shape from this target (default: SmolLM2's).")] = None,
    num_layers: Annotated[int, Opt("Drafter decoder layers (drafter.num_layers).")] = 1,
) -> dict:
    """draft_vocab_size 0 or None: the full target vocabulary."""
    arch = bench_arch("peagle", 1, draft_vocab_size or None, num_layers, target)
    result = {
        "hidden_size": arch.hidden_size,
        "layers": arch.num_layers,
        "draft_vocab_size": arch.draft_vocab_size,
        "context": context,
        "threads": torch.get_num_threads(),
        "dtype": "bfloat16",
    }
    for key, dtype in (("ms", torch.bfloat16), ("ms_float32", torch.float32)):
        ms = {
            a: {
                str(k): round(proposal_ms(a, k, draft_vocab_size, context, repeats, target, dtype, num_layers), 3)
                for k in range(1, max_k + 1)
            }
            for a in get_args(Algorithm)  # peagle, eagle3
        }
        result[key] = ms
        result[f"ratio_k{max_k}_over_k1" + key.removeprefix("ms")] = {
            a: round(ms[a][str(max_k)] / ms[a]["1"], 3) for a in ms
        }
    return result
