"""One vLLM engine configuration of an evaluation, run in its own process (a fresh process per configuration keeps
timings independent; on CPU vLLM's engine core and model run inside it, engine.py):

    python -m peagle_ray.eval.vllm_run SPEC.json OUT.json

SPEC: {"engine_args" (engine.engine_args, with or without a drafter), "max_new_tokens",
       "acceptance": {category: [prompt ids, ...]}, "timing": {category: n (the first n acceptance prompts)},
       "warmup": [prompt ids, ...] (optional: generated first, e.g. to fill suffix decoding's response cache)}
OUT:  {"acceptance": {category: {"tokens": [[ids]...], "counters": {...}}},
       "timing": {category: {"tokens": n, "seconds": s, "per_prompt": [[tokens, seconds], ...], "counters": {...}}},
       "engine_start_s": s}

Each prompt is generated exactly once. The timed prompts of a category run first, one at a time (batch 1, the
latency a user sees), each after the prefix cache is emptied; the rest of the category then runs as one
batch. A category's acceptance counts and tokens are both parts together (vLLM's counters are read before
and after each part). Once only, and timing first: a decoder that learns from what it generated (suffix
decoding's response cache) would otherwise be timed on prompts whose answers it had already seen. The
prefix cache is emptied because vLLM reuses less of a cached prompt when an EAGLE drafter runs (it drops
back a KV block to rebuild the drafter's state), so cached timings favoured the target alone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def run(spec: dict) -> dict:
    from peagle_ray.engine import use_local_cores

    use_local_cores()
    from vllm import LLM, SamplingParams

    from peagle_ray.spec_counters import SpecStats, counters_from_snapshot

    started = time.perf_counter()
    llm = LLM(**spec["engine_args"])
    out: dict[str, Any] = {"engine_start_s": time.perf_counter() - started, "acceptance": {}, "timing": {}}
    sampling = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    if spec.get("warmup"):
        llm.generate([{"prompt_token_ids": p} for p in spec["warmup"]], sampling, use_tqdm=False)
    stats = lambda: SpecStats.from_counters(counters_from_snapshot(llm.get_metrics()))  # noqa: E731
    warm = spec.get("warmup") or [next(iter(spec["acceptance"].values()))[0]]
    llm.generate([{"prompt_token_ids": warm[0]}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    for category, prompts in spec["acceptance"].items():
        timed = prompts[: spec["timing"].get(category, 0)]
        tokens, per_prompt, before = [], [], stats()
        for prompt in timed:
            llm.reset_prefix_cache()
            start = time.perf_counter()
            (output,) = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
            per_prompt.append([len(output.outputs[0].token_ids), time.perf_counter() - start])
            tokens.append(list(output.outputs[0].token_ids))
        timing = stats().minus(before)
        out["timing"][category] = {
            "tokens": sum(n for n, _ in per_prompt),
            "seconds": sum(s for _, s in per_prompt),
            "per_prompt": per_prompt,
            "counters": timing.__dict__,
        }
        before = stats()
        rest = prompts[len(timed) :]
        if rest:
            outputs = llm.generate([{"prompt_token_ids": p} for p in rest], sampling, use_tqdm=False)
            tokens += [list(o.outputs[0].token_ids) for o in outputs]
        counts = timing + stats().minus(before)
        out["acceptance"][category] = {"tokens": tokens, "counters": counts.__dict__}
        print(f"[eval] acceptance {category}: AL {counts.acceptance_length:.3f}", file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    spec_file, out_file = sys.argv[1:3]
    result = run(json.loads(Path(spec_file).read_text()))
    Path(out_file).write_text(json.dumps(result))
