"""`peagle-ray bench mask`: where the attention mask stands in a training step (why the job rebuilds it).

For each (N, K): a fresh COD sampling per step (as the job samples), and
  * rebuilt_ms      - the dense mask built from the sampled elements (the job's CPU path),
  * table_gather_ms - the same mask gathered from a table of every (anchor, depth) pair built once for N
                      (the paper's amortization made gradient-equivalent to fresh sampling), with the
                      table's size and build time (it grows as (N K)^2: 4 GiB at N = 8192, K = 8),
  * step_s          - one forward + backward of a SmolLM2-shaped drafter (1 layer, draft vocabulary 32768,
                      frozen head, float32) on those elements, masks rebuilt inside,
  * mask_share_of_step = rebuilt_ms / step_s.
On GPU the step uses a flex BlockMask (create_block_mask over the rule's mask_mod), which a dense table cannot
feed; on CPU the rebuilt mask is a small share of a step (docs/bench_mask_smollm2.json, docs/benchmarks.md),
so the job rebuilds it.
"""

from __future__ import annotations

import statistics
import time
from typing import Annotated

import torch

from peagle_ray.bench.shapes import bench_arch, random_drafter, random_sequence
from peagle_ray.config import DrafterConfig
from peagle_ray.drafter.elements import Elements, attention_mask
from peagle_ray.options import Opt
from peagle_ray.train.elements import cod_sample
from peagle_ray.train.step import sequence_backward

UNPARTITIONED = 10**9


def _seconds(fn, *args) -> float:
    """Seconds of one call fn(*args)."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def one_shape(n: int, k: int, steps: int, draft_vocab_size: int, generator: torch.Generator) -> dict:
    cod = DrafterConfig(num_depths=k)
    grid = Elements(torch.arange(n).repeat_interleave(k), torch.arange(k).repeat(n))  # every (anchor, depth)
    one_document = torch.zeros(n, dtype=torch.long)
    table: dict[str, torch.Tensor] = {}
    build_s = _seconds(lambda: table.setdefault("mask", attention_mask(grid, grid, one_document)))
    arch = bench_arch("peagle", k, draft_vocab_size)
    drafter, teacher = random_drafter(arch)
    drafter.lm_head.weight.requires_grad_(False)
    seq = random_sequence(arch, n, generator)
    rebuilt, gathered, step = [], [], []
    for _ in range(steps):
        elements = cod_sample(seq.supervised, seq.doc_ids, k, cod.cod_keep_ratio, cod.cod_min_ratio, generator)
        index = elements.anchor * k + elements.depth
        rebuilt.append(_seconds(attention_mask, elements, elements, seq.doc_ids))
        gathered.append(_seconds(table["mask"].__getitem__, (index[:, None], index[None, :])))
        drafter.zero_grad(set_to_none=True)
        step.append(_seconds(sequence_backward, drafter, teacher, seq, elements, UNPARTITIONED, None))
    rebuilt_ms, step_s = 1000 * statistics.median(rebuilt), statistics.median(step)
    return {
        "max_positions": n,
        "depths": k,
        "elements": len(elements),
        "rebuilt_ms_per_step": round(rebuilt_ms, 3),
        "table_gather_ms_per_step": round(1000 * statistics.median(gathered), 3),
        "table_mb": round(table["mask"].numel() / 2**20, 1),
        "table_build_s": round(build_s, 3),
        "step_s": round(step_s, 3),
        "mask_share_of_step": round(rebuilt_ms / 1000 / step_s, 4),
    }


def run(
    max_positions: Annotated[tuple[int, ...], Opt("Positions N of each row.")] = (1024, 2048),
    depths: Annotated[tuple[int, ...], Opt("K of each row (zipped with --max-positions).")] = (4, 8),
    steps: Annotated[int, Opt("Steps timed per row (median).")] = 3,
    draft_vocab_size: Annotated[int, Opt("Draft vocabulary.")] = 32768,
) -> dict:
    """One row per (N, K) pair of max_positions x depths, zipped (N = 1024 with K = 4, 2048 with 8)."""
    rows = [
        one_shape(n, k, steps, draft_vocab_size, torch.Generator().manual_seed(0))
        for n, k in zip(max_positions, depths, strict=True)
    ]
    return {"steps_per_row": steps, "draft_vocab_size": draft_vocab_size, "rows": rows}
