"""The environment every CPU vLLM engine is started with (peagle_ray.engine)."""

from peagle_ray.config import PeagleConfig, with_values
from peagle_ray.engine import intel_openmp_library, target_engine_env, vllm_cpu_env


def test_kv_cache_and_openmp_preload_are_set():
    env = vllm_cpu_env(3, {"LD_PRELOAD": "/x/libfoo.so"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env  # vLLM's default unless configured
    iomp = intel_openmp_library()
    assert env["LD_PRELOAD"] == (f"{iomp}:/x/libfoo.so" if iomp else "/x/libfoo.so")
    assert vllm_cpu_env(3, env)["LD_PRELOAD"] == env["LD_PRELOAD"]  # not preloaded twice


def test_reserved_cores_follow_config_and_environment_wins():
    cfg = with_values(PeagleConfig(), {"target.cpu_reserved_cores": 0, "target.kv_cache_gib": 4})
    env = target_engine_env(cfg.target, {})
    assert (env["VLLM_CPU_NUM_OF_RESERVED_CPU"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("0", "4")
    assert target_engine_env(cfg.target, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in target_engine_env(PeagleConfig().target, {})
