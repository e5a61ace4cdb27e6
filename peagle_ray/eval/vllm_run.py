"""One vLLM engine configuration of an evaluation, run in its own process (vLLM spawns workers, and a fresh
process per configuration keeps timings independent):

    python -m peagle_ray.eval.vllm_run SPEC.json OUT.json

SPEC: {"engine_args" (engine.engine_args, with or without a drafter), "max_new_tokens",
       "acceptance": {category: [prompt ids, ...]}, "timing": {category: [prompt ids, ...]},
       "warmup": [prompt ids, ...] (optional: generated first, e.g. to fill suffix decoding's response cache)}
OUT:  {"acceptance": {category: {"tokens": [[ids]...], "counters": {...}}},
       "timing": {category: {"tokens": n, "seconds": s, "counters": {...}}}, "engine_start_s": s}

Acceptance prompts of a category run as one batch (vLLM's counters are read before and after, so each
category gets its own counts); timing prompts run one at a time (batch 1, the latency a user sees), each
after the prefix cache is emptied: they were just seen in the acceptance batches, and vLLM reuses less of a
cached prompt when an EAGLE drafter runs (it drops back a KV block to rebuild the drafter's state), so cached
timings favoured the target alone on long prompts with short answers (tool_calls measured ~0.5x).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from peagle_ray.serve.stats import SpecStats, counters_from_snapshot

    started = time.perf_counter()
    llm = LLM(**spec["engine_args"])
    out = {"engine_start_s": time.perf_counter() - started, "acceptance": {}, "timing": {}}
    sampling = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    if spec.get("warmup"):
        llm.generate([{"prompt_token_ids": p} for p in spec["warmup"]], sampling, use_tqdm=False)
    stats = lambda: SpecStats.from_counters(counters_from_snapshot(llm.get_metrics()))  # noqa: E731
    for category, prompts in spec["acceptance"].items():
        before = stats()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        counts = stats().minus(before)
        out["acceptance"][category] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "counters": counts.__dict__,
        }
        print(f"[eval] acceptance {category}: AL {counts.acceptance_length:.3f}", file=sys.stderr, flush=True)
    llm.generate(
        [{"prompt_token_ids": spec["acceptance"][next(iter(spec["acceptance"]))][0]}],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )  # warm-up before timing
    for category, prompts in spec["timing"].items():
        tokens, seconds, before = 0, 0.0, stats()
        for prompt in prompts:
            llm.reset_prefix_cache()
            start = time.perf_counter()
            (output,) = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens += len(output.outputs[0].token_ids)
        out["timing"][category] = {"tokens": tokens, "seconds": seconds, "counters": stats().minus(before).__dict__}
    return out


if __name__ == "__main__":
    spec_file, out_file = sys.argv[1:3]
    result = run(json.loads(Path(spec_file).read_text()))
    Path(out_file).write_text(json.dumps(result))
