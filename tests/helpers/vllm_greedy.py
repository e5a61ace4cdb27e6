"""Greedy-decode chat prompts with vLLM and print the token ids as JSON (run as a subprocess: vLLM spawns).

python tests/helpers/vllm_greedy.py MODEL_DIR MESSAGES_JSON MAX_TOKENS
"""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model_dir, messages, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
    outputs = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
