"""Greedy decoding with vLLM, optionally with a speculators-format drafter; prints token ids and
acceptance counters as JSON (run as a subprocess: vLLM spawns). The engine is built as peagle-ray builds
every engine (engine.engine_args, export.speculative_config).

    python tests/helpers/vllm_spec.py TARGET DRAFTER|none K PARALLEL(0|1) PROMPTS_JSON MAX_TOKENS
"""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    from peagle_ray.config import build_config
    from peagle_ray.engine import engine_args
    from peagle_ray.export.speculators import DrafterInfo, speculative_config

    target, drafter, k, parallel, prompts, max_tokens = sys.argv[1:7]
    cfg = build_config({"target": {"dtype": "float32", "max_model_len": 512}})
    spec = None
    if drafter != "none":
        spec = speculative_config(DrafterInfo(drafter, "peagle" if parallel == "1" else "eagle3", int(k)))
    llm = LLM(**engine_args(cfg, target, on_gpu=False, speculative_config=spec))
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in json.loads(prompts)],
        SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True),
    )
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs], "metrics": metrics}))
