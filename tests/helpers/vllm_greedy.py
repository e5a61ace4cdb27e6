"""Greedy-decode chat prompts with vLLM and print the token ids as JSON (run as a subprocess: vLLM spawns).
The engine is built as peagle-ray builds every engine (engine.engine_args).

python tests/helpers/vllm_greedy.py MODEL_DIR MESSAGES_JSON MAX_TOKENS
"""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    from peagle_ray.config import build_config
    from peagle_ray.engine import engine_args

    model_dir, messages, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    cfg = build_config({"target": {"dtype": "float32", "max_model_len": 1024}})
    llm = LLM(**engine_args(cfg, model_dir, on_gpu=False))
    outputs = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
