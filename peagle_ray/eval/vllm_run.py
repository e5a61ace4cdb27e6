"""One decoder's vLLM engine in an evaluation, in its own process (on CPU vLLM's engine core and model run
inside it, engine.py), driven command by command by eval/compare.py:

    python -m peagle_ray.eval.vllm_run SPEC.json --driven FD   # driven by eval/compare.py, prompt by prompt
    python -m peagle_ray.eval.vllm_run --host FD               # CPU: imports vLLM once, forks each driven engine

SPEC: {"engine_args" (engine.engine_args, with or without a drafter), "max_new_tokens",
       "acceptance": {category: [prompt ids, ...]}, "timing": {category: n (the first n acceptance prompts)},
       "warmup": [prompt ids, ...] (optional: generated first, e.g. to fill suffix decoding's response cache)}
OUT:  {"acceptance": {category: {"tokens": [[ids]...], "counters": {...}}},
       "timing": {category: {"tokens": n, "seconds": s, "per_prompt": [[tokens, seconds, drafts, accepted], ...],
                  "counters": {...}}},
       "engine_start_s": s}

The process reads one JSON command per line on stdin and answers each with one JSON line on file
descriptor FD (vLLM's own output stays on stdout and stderr, in the log): after {"ready": true},
{"time": [category, i]} times acceptance prompt i of a category, {"finish": rest} returns OUT (running the
untimed prompts first when `rest`) and exits. compare.py keeps several such engines alive side by side and
times them in turn, prompt by prompt, so that no verdict comes from drift between engine runs (run_engine
drives one alone).

Each prompt is generated exactly once. A timed prompt runs alone (batch 1, the latency a user sees) after the
prefix cache is emptied; every timed prompt runs before any untimed one, which then run as one batch per
category. Timing first: a decoder that learns from what it generated (suffix decoding's response cache) would
otherwise be timed on prompts whose answers it had already seen. The prefix cache is emptied because vLLM
reuses less of a cached prompt when an EAGLE drafter runs (it drops back a KV block to rebuild the drafter's
state), so cached timings favoured the target alone. vLLM's counters are read before and after each part, so
a category's acceptance counts both its parts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from peagle_ray.spec_counters import SpecStats


class Decoder:
    """One engine over SPEC's prompts, driven prompt by prompt: time(category, i) for the timed prompts, then
    finish() for the rest and OUT."""

    def __init__(self, spec: dict):
        from peagle_ray.engine import use_local_cores

        use_local_cores()
        from vllm import LLM, SamplingParams

        from peagle_ray.spec_counters import counters_from_snapshot

        self.spec = spec
        started = time.perf_counter()
        self.llm = LLM(**spec["engine_args"])
        self.engine_start_s = time.perf_counter() - started
        self.sampling = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
        self.stats = lambda: SpecStats.from_counters(counters_from_snapshot(self.llm.get_metrics()))
        if spec.get("warmup"):
            self.llm.generate([{"prompt_token_ids": p} for p in spec["warmup"]], self.sampling, use_tqdm=False)
        warm = spec.get("warmup") or [next(iter(spec["acceptance"].values()))[0]]
        self.llm.generate(
            [{"prompt_token_ids": warm[0]}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
        )
        categories = spec["acceptance"]
        self.tokens: dict[str, list[list[int]]] = {c: [] for c in categories}
        self.per_prompt: dict[str, list[list[float]]] = {c: [] for c in categories}
        self.timing = {c: SpecStats() for c in categories}
        self.timing_sources: dict[str, dict[str, SpecStats]] = {c: {} for c in categories}

    def time(self, category: str, index: int) -> list[float]:
        """Time acceptance prompt `index` of `category` alone; the prompts of a category in order, each once."""
        assert index == len(self.tokens[category]), f"{category}: prompt {index} out of order"
        prompt = self.spec["acceptance"][category][index]
        before, sources = self.stats(), by_source()
        self.llm.reset_prefix_cache()
        start = time.perf_counter()
        (output,) = self.llm.generate([{"prompt_token_ids": prompt}], self.sampling, use_tqdm=False)
        seconds = time.perf_counter() - start
        ids = list(output.outputs[0].token_ids)
        self.tokens[category].append(ids)
        counts = self.stats().minus(before)
        self.per_prompt[category].append([len(ids), seconds, counts.drafts, counts.accepted_tokens])
        self.timing[category] = self.timing[category] + counts
        self.timing_sources[category] = added(self.timing_sources[category], since(sources))
        return [len(ids), seconds]

    def finish(self, rest: bool = True) -> dict[str, Any]:
        """OUT; with `rest`, each category's untimed prompts first run as one batch."""
        out: dict[str, Any] = {"engine_start_s": self.engine_start_s, "acceptance": {}, "timing": {}}
        for category, prompts in self.spec["acceptance"].items():
            timed, counts = self.per_prompt[category], self.timing[category]
            out["timing"][category] = {
                "tokens": sum(t[0] for t in timed),
                "seconds": sum(t[1] for t in timed),
                "per_prompt": timed,
                "counters": counts.__dict__,
            }
            tokens, untimed = list(self.tokens[category]), prompts[len(timed) :]
            sources = self.timing_sources[category]
            if rest and untimed:
                before, before_sources = self.stats(), by_source()
                outputs = self.llm.generate([{"prompt_token_ids": p} for p in untimed], self.sampling, use_tqdm=False)
                tokens += [list(o.outputs[0].token_ids) for o in outputs]
                counts = counts + self.stats().minus(before)
                sources = added(sources, since(before_sources))
            out["acceptance"][category] = {"tokens": tokens, "counters": counts.__dict__}
            if sources:  # the hybrid: what each source drafted (peagle_ray/hybrid.py)
                out["acceptance"][category]["by_source"] = {s: c.__dict__ for s, c in sources.items()}
            print(f"[eval] acceptance {category}: AL {counts.acceptance_length:.3f}", file=sys.stderr, flush=True)
        return out


def by_source() -> dict:
    """The hybrid decoder's counts per source so far in this process (empty for any other decoder)."""
    from peagle_ray.hybrid import STATS

    return {source: SpecStats(**vars(counts)) for source, counts in STATS.items()}


def since(before: dict) -> dict:
    return {source: counts.minus(before.get(source, SpecStats())) for source, counts in by_source().items()}


def added(a: dict, b: dict) -> dict:
    return {source: a.get(source, SpecStats()) + b.get(source, SpecStats()) for source in {*a, *b}}


def serve_commands(spec: dict, replies) -> None:
    """Commands on stdin (module docstring), one JSON answer per line on `replies`."""

    def answer(value) -> None:
        replies.write(json.dumps(value) + "\n")
        replies.flush()

    decoder = Decoder(spec)
    answer({"ready": True, "engine_start_s": decoder.engine_start_s})
    for line in sys.stdin:
        command = json.loads(line)
        if "time" in command:
            answer(decoder.time(*command["time"]))
        elif "finish" in command:
            answer(decoder.finish(command["finish"]))
            return


# What every engine's LLM() imports (the hybrid plugin's runner, the CPU worker, the engine core): imported once
# in the host instead of in each child (~2.5 s each on the tiny target).
PRELOAD = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.worker.cpu_worker",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.layers.fused_moe",
    "vllm.lora.layers",
)


def preload() -> None:
    """vLLM and PRELOAD imported (a module missing from this vLLM release is skipped), then the heap frozen:
    a forked child's collections skip what it inherited (and leave those pages shared)."""
    import gc
    import importlib

    from vllm import LLM, SamplingParams  # noqa: F401 - what every child's Decoder imports first

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as err:
            print(f"[engine host] {name} not preloaded: {err}", file=sys.stderr, flush=True)
    gc.freeze()


def host(sock_fd: int) -> None:
    """`--host FD` (CPU only; eval/compare.py EngineHost): vLLM imported once, then one driven engine forked per
    request on the UNIX socket FD. A request is {"spec": SPEC's path, "cwd": the driver's} with three descriptors
    (commands in, replies out, the log); the answer is the child's pid on a line. Ends when the socket closes."""
    import signal
    import socket

    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    sock = socket.socket(fileno=sock_fd)
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(sock, 4096, 3)
        except OSError:
            return
        if not message:
            return
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd, std in ((fds[0], 0), (fds[2], 1), (fds[2], 2)):  # stdin: commands; stdout, stderr: the log
                    os.dup2(fd, std)
                request = json.loads(message)
                os.chdir(request["cwd"])  # the driver's: paths in SPEC may be relative to it
                code = driven(Path(request["spec"]), os.fdopen(fds[1], "w"))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        for fd in fds:
            os.close(fd)
        sock.sendall(f"{pid}\n".encode())


def driven(spec_file: Path, replies) -> int:
    """serve_commands for SPEC's file; on an error its traceback goes to the log and {"error": what} to
    `replies` (eval/compare.py raises it, naming the log). The exit code."""
    import traceback

    try:
        serve_commands(json.loads(spec_file.read_text()), replies)
        return 0
    except Exception as err:  # noqa: BLE001 - reported to the driver, which decides
        traceback.print_exc()
        try:
            replies.write(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
            replies.flush()
        except OSError:
            pass  # the driver is gone
        return 1


if __name__ == "__main__":
    if sys.argv[1] == "--host":
        host(int(sys.argv[2]))
    else:
        spec_file, _driven, fd = sys.argv[1:]
        sys.exit(driven(Path(spec_file), os.fdopen(int(fd), "w")))
