"""Greedy decoding with vLLM, optionally with a speculators-format drafter; prints token ids and
acceptance counters as JSON (run as a subprocess: vLLM spawns).

    python tests/helpers/vllm_spec.py TARGET DRAFTER|none K PARALLEL(0|1) PROMPTS_JSON MAX_TOKENS
"""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    target, drafter, k, parallel, prompts, max_tokens = sys.argv[1:7]
    kwargs = {}
    if drafter != "none":
        kwargs["speculative_config"] = {
            "model": drafter,
            "method": "eagle3",
            "num_speculative_tokens": int(k),
            "parallel_drafting": parallel == "1",
        }
    llm = LLM(
        model=target, dtype="float32", enforce_eager=True, max_model_len=512, seed=0, disable_log_stats=False, **kwargs
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in json.loads(prompts)],
        SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True),
    )
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs], "metrics": metrics}))
