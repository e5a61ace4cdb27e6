"""Greedy decoding with vLLM, optionally with a speculators-format drafter, in one long-lived process: vLLM is
imported once (~25 s on the 2-core box) and each job builds its own engine (~4 s), as peagle-ray builds every
engine (engine.engine_args, export.speculative_config), decodes and frees it. A job is a JSON line on stdin,
its result a line `RESULT {"tokens": [...], "metrics": {...}}` on stdout (vLLM's own logs go there too).

    job: {"target": DIR, "drafter": DIR or null, "k": K, "parallel": bool, "prompts": [[ids]], "max_tokens": N}

VllmJobs (below) starts it (as a subprocess: vLLM must not be imported by the test process) and sends jobs.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    from peagle_ray.config import build_config
    from peagle_ray.engine import engine_args
    from peagle_ray.export.speculators import DrafterInfo, speculative_config

    cfg = build_config({"target": {"dtype": "float32", "max_model_len": 512}})
    spec = None
    if job["drafter"]:
        algorithm = "peagle" if job["parallel"] else "eagle3"
        spec = speculative_config(DrafterInfo(job["drafter"], algorithm, int(job["k"])))
    llm = LLM(**engine_args(cfg, job["target"], on_gpu=False, speculative_config=spec))
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in job["prompts"]],
            SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), ignore_eos=True),
        )
        metrics = {}
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode"):
                metrics[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "metrics": metrics}
    finally:
        del llm
        gc.collect()


class VllmJobs:
    """The engine process for a test module: `run(...)` sends one job and returns its result; `close()` ends
    the process. Its stderr goes to `log` (read back when a job fails)."""

    def __init__(self, env: dict[str, str], log: Path):
        self.log = log
        self._stderr = log.open("w")
        self._process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )

    def run(self, target, drafter, k: int, parallel: bool, prompts: list[list[int]], max_tokens: int) -> dict:
        job = {"target": str(target), "drafter": str(drafter) if drafter else None, "k": k, "parallel": parallel}
        job |= {"prompts": prompts, "max_tokens": max_tokens}
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(job) + "\n")
        self._process.stdin.flush()
        for line in self._process.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line.removeprefix("RESULT "))
                assert "error" not in result, result["error"] + self.log.read_text()[-3000:]
                return result
        raise AssertionError(f"the vLLM process exited ({self._process.wait()}): {self.log.read_text()[-3000:]}")

    def close(self) -> None:
        try:
            self._process.communicate(timeout=60)  # stdin closed: the loop ends; its last logs drained
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._stderr.close()


if __name__ == "__main__":
    for line in sys.stdin:
        try:
            result = run_job(json.loads(line))
        except Exception as err:  # noqa: BLE001 - the test names it
            result = {"error": repr(err)}
        print("RESULT " + json.dumps(result), flush=True)
