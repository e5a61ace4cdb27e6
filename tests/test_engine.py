"""The environment every CPU vLLM engine is started with (peagle_ray.engine)."""

import os

import pytest

from peagle_ray.config import PeagleConfig, with_values
from peagle_ray.engine import intel_openmp_library, target_engine_env, vllm_cpu_env


def test_kv_cache_and_openmp_preload_are_set(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)  # tests/conftest.py sets it under xdist
    env = vllm_cpu_env(3, {"LD_PRELOAD": "/x/libfoo.so"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env  # vLLM's default unless configured
    iomp = intel_openmp_library()
    assert env["LD_PRELOAD"] == (f"{iomp}:/x/libfoo.so" if iomp else "/x/libfoo.so")
    assert vllm_cpu_env(3, env)["LD_PRELOAD"] == env["LD_PRELOAD"]  # not preloaded twice


def test_reserved_cores_follow_config_and_environment_wins(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    cfg = with_values(PeagleConfig(), {"target.cpu_reserved_cores": 0, "target.kv_cache_gib": 4})
    env = target_engine_env(cfg.target, {})
    assert (env["VLLM_CPU_NUM_OF_RESERVED_CPU"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("0", "4")
    assert target_engine_env(cfg.target, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in target_engine_env(PeagleConfig().target, {})
    # this process's environment reaches an engine started from an environment of its own (a Serve replica's)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert target_engine_env(cfg.target, {})["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert target_engine_env(PeagleConfig().target, {})["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_xdist_workers_share_the_cores():
    from tests.conftest import share_the_cores_between_workers

    assert share_the_cores_between_workers({}) is None  # one process: untouched
    cores = len(os.sched_getaffinity(0))
    environ = {"PYTEST_XDIST_WORKER_COUNT": "2"}
    threads = share_the_cores_between_workers(environ)
    assert threads == max(1, cores // 2) and environ["OMP_NUM_THREADS"] == str(threads)
    assert environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == str(cores - threads)
    mine = {"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "7"}
    share_the_cores_between_workers(mine)
    assert mine["OMP_NUM_THREADS"] == "7"  # a value the user set wins


def test_one_engine_builder_serves_capture_serving_and_eval_alike(tmp_path):
    from peagle_ray.capture.target_server import engine_spec
    from peagle_ray.engine import cli_args, engine_args

    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 10}')
    cfg = with_values(PeagleConfig(), {"target.seed": 7, "target.max_model_len": 333, "capture.aux_layer_ids": [1, 2]})
    plain = engine_args(cfg, tmp_path, on_gpu=False)
    assert (plain["model"], plain["seed"], plain["max_model_len"], plain["enforce_eager"]) == (
        str(tmp_path),
        7,
        333,
        True,
    )
    assert "speculative_config" not in plain and engine_args(cfg, tmp_path, on_gpu=True)["enforce_eager"] is False
    capture = engine_spec(cfg, tmp_path, num_target_layers=4)
    assert {k: v for k, v in capture.engine_args.items() if k != "speculative_config"} == plain
    assert capture.engine_args["speculative_config"]["draft_model_config"] == {
        "hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}
    }
    assert (capture.on_gpu, capture.num_layers) == (False, 3)
    assert engine_spec(with_values(cfg, {"capture.num_gpus": 1}), tmp_path, 4).engine_args["enforce_eager"] is False
    flags = cli_args({**plain, "speculative_config": {"method": "eagle3"}})
    assert flags[:4] == ["--model", str(tmp_path), "--dtype", "float32"] and "--enforce-eager" in flags
    assert "--disable-log-stats" not in flags and flags[-2:] == ["--speculative-config", '{"method": "eagle3"}']


@pytest.mark.slow
def test_server_flags_parse_back_to_the_same_engine_arguments(tmp_path):
    """vLLM's own argument parser reads cli_args(engine_args(...)) as the same EngineArgs the LLM class gets."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from peagle_ray.engine import cli_args, engine_args

    spec = {"model": str(tmp_path), "method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True}
    args = engine_args(with_values(PeagleConfig(), {"target.seed": 3}), tmp_path, False, spec)
    parsed = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(cli_args(args)))
    direct = EngineArgs(**args)
    for field in args:
        assert getattr(parsed, field) == getattr(direct, field), field


def test_a_cpu_engine_runs_its_model_in_the_engine_core_process(tmp_path):
    from peagle_ray.engine import engine_args

    cfg = PeagleConfig()
    assert engine_args(cfg, tmp_path, on_gpu=False)["distributed_executor_backend"] == "uni"
    assert "distributed_executor_backend" not in engine_args(cfg, tmp_path, on_gpu=True)  # vLLM's default
    assert vllm_cpu_env(1, {})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert vllm_cpu_env(1, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_the_model_threads_take_the_cores_an_engine_may_use(monkeypatch):
    from peagle_ray.engine import use_local_cores

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as Ray sets it in an actor that claims no CPU
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert use_local_cores() is None and os.environ["OMP_NUM_THREADS"] == "1"  # a GPU engine's: unchanged
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert use_local_cores() == cores and os.environ["OMP_NUM_THREADS"] == str(cores)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cores))
    assert use_local_cores() == 1  # never fewer than one thread
