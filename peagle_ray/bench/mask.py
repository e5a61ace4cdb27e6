"""`peagle-ray bench mask`: attention-mask time per step, amortized (built once, sliced) vs rebuilt.

Each step draws a sequence length in [N/2, N] (as real data varies); 'rebuilt' runs COD sampling and builds
the mask for that length, 'amortized' slices the mask built once for N.
"""

from __future__ import annotations

import statistics
import time

import torch

from peagle_ray.config import DrafterConfig
from peagle_ray.drafter.elements import attention_mask
from peagle_ray.train.elements import cod_sample
from peagle_ray.train.masks import AmortizedMask


def _median_ms(fn, lengths) -> float:
    times = []
    for n in lengths:
        start = time.perf_counter()
        fn(n)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def run(max_positions: tuple[int, ...] = (1024, 2048, 4096), num_depths: int = 4, steps: int = 10) -> dict:
    rows, cod = [], DrafterConfig()  # the configured COD ratios
    for n_max in max_positions:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(n_max // 2, n_max + 1, (steps,), generator=g).tolist()
        start = time.perf_counter()
        amortized = AmortizedMask(n_max, num_depths, cod.cod_keep_ratio, cod.cod_min_ratio, g)
        build_ms = 1000 * (time.perf_counter() - start)

        def rebuilt(n):
            sup, doc = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
            elements = cod_sample(sup, doc, num_depths, cod.cod_keep_ratio, cod.cod_min_ratio, g)
            return attention_mask(elements, elements, doc)

        rebuilt_ms = _median_ms(rebuilt, lengths)
        amortized_ms = _median_ms(lambda n: amortized.for_length(n), lengths)
        rows.append(
            {
                "max_positions": n_max,
                "depths": num_depths,
                "elements_at_max": len(amortized.elements),
                "one_time_build_ms": round(build_ms, 3),
                "rebuilt_ms_per_step": round(rebuilt_ms, 3),
                "amortized_ms_per_step": round(amortized_ms, 4),
                "speedup": round(rebuilt_ms / max(amortized_ms, 1e-6), 1),
            }
        )
    return {"rows": rows}
