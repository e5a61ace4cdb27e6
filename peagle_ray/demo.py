"""The main job on the embedded default: `peagle-ray demo` / `make demo`.

So far: prepare the embedded SmolLM2 target (or use target.path), serve it with vLLM's OpenAI-compatible
server on CPU, ask one chat question over HTTP and print the answer. The later stages (data, capture,
training, export, drafting-enabled serving, evaluation) join this job as they are built.
"""

from __future__ import annotations

import time
from pathlib import Path

from peagle_ray.config import PeagleConfig
from peagle_ray.serve.openai_process import VllmOpenAIServer
from peagle_ray.target import prepare_embedded_target

DEMO_QUESTION = "Explain in two sentences what speculative decoding is."


def run_demo(cfg: PeagleConfig, question: str = DEMO_QUESTION, max_tokens: int = 96) -> str:
    """Prepare the target, serve it, ask `question`, print and return the answer."""
    start = time.monotonic()
    target = Path(cfg.target.path) if cfg.target.path else prepare_embedded_target(cfg.cache_path())
    print(f"[demo] target: {target}")
    print("[demo] starting vLLM OpenAI server (CPU, first start takes ~30-60 s) ...")
    with VllmOpenAIServer(target, cfg) as server:
        print(f"[demo] serving {server.served_name} at {server.url}/v1 (log: {server.log_path})")
        response = server.chat([{"role": "user", "content": question}], max_tokens=max_tokens)
    answer = response["choices"][0]["message"]["content"]
    usage = response.get("usage", {})
    print(f"[demo] user: {question}")
    print(f"[demo] {server.served_name}: {answer}")
    print(f"[demo] {usage.get('completion_tokens', '?')} tokens; total wall time {time.monotonic() - start:.0f} s")
    return answer
