"""The target in Ray Serve: one vLLM engine that regenerates responses and captures hidden states.

The engine runs vLLM's `extract_hidden_states` speculative method with a hidden-states connector (ours on
CPU, vLLM's stock one on GPU). A capture request is a batch of 1-token generations over full conversations,
which the engine prefills together: the connector writes the hidden states of every prompt position to a file
on the replica's node; the replica reads each, deletes it (and its lock), and returns the arrays through Ray's
object store (numpy, zero-copy; see capture/stage.py for the wire format), so capture works across nodes
without a shared filesystem.

    handle = start_target_server(cfg, target_dir)          # serve.run, no HTTP route
    handle.capture_batch.remote([ids, ...]).result()      # {"items": [wire dict per sequence], "timing": {...}}
    handle.generate.remote(prompt_ids, max_tokens, temperature).result()   # generated token ids
    stop_target_server()
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass

from ray import serve

from peagle_ray.capture.stage import APP_NAME
from peagle_ray.cluster import ensure_serve_http
from peagle_ray.config import PeagleConfig
from peagle_ray.engine import engine_args, target_engine_env, use_local_cores

CPU_CONNECTOR = ("CPUHiddenStatesConnector", "peagle_ray.capture.connector")
GPU_CONNECTOR = ("ExampleHiddenStatesConnector", None)


@dataclass(frozen=True)
class EngineSpec:
    """What the replica needs to build its engine; plain data so it travels to any node."""

    engine_args: dict  # engine.engine_args of the target, with the extract_hidden_states speculative config
    on_gpu: bool  # capture.num_gpus > 0: vLLM's stock connector; on CPU ours
    num_layers: int  # layers captured: the aux layers, then the last layer


def capture_speculative_config(layer_ids: list[int]) -> dict:
    """vLLM's extract_hidden_states method: the inputs of `layer_ids` (aux layers, then the last layer L)."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }


def kv_transfer_config(on_gpu: bool, storage_dir: str) -> dict:
    """The hidden-states connector writing each request's states under storage_dir on the replica's node."""
    connector, module = GPU_CONNECTOR if on_gpu else CPU_CONNECTOR
    config = {
        "kv_connector": connector,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_dir},
    }
    if module:
        config["kv_connector_module_path"] = module
    return config


@serve.deployment(name="TargetServer", max_ongoing_requests=64)
class TargetServer:
    def __init__(self, spec: EngineSpec):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        use_local_cores()
        self.storage_dir = tempfile.mkdtemp(prefix="peagle-hidden-")
        args = AsyncEngineArgs(**spec.engine_args, kv_transfer_config=kv_transfer_config(spec.on_gpu, self.storage_dir))
        self.engine = AsyncLLM.from_engine_args(args)
        self.num_layers = spec.num_layers

    async def _run(self, token_ids: list[int], sampling) -> tuple[list[int], str | None]:
        from vllm.inputs import TokensPrompt

        final = None
        async for output in self.engine.generate(TokensPrompt(prompt_token_ids=token_ids), sampling, uuid.uuid4().hex):
            final = output
        if final is None:
            raise RuntimeError("the target engine returned no output")
        return list(final.outputs[0].token_ids), (final.kv_transfer_params or {}).get("hidden_states_path")

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int = 0) -> list[int]:
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        tokens, path = await self._run(prompt_ids, sampling)
        if path:  # the connector also saved this request's prompt states; we do not need them
            load_hidden_states(path)  # waits for the writer's lock before deleting
            cleanup_hidden_states(path)
        return tokens

    def hidden_dtype(self) -> str:
        """The dtype the captured states travel in: the engine's model dtype, e.g. "float32", "bfloat16"."""
        from peagle_ray.capture.pipeline import dtype_name

        return dtype_name(self.engine.model_config.dtype)

    async def capture_batch(self, batch: list[list[int]]) -> dict:
        """Hidden states of every position of each sequence, prefilled together: {"items": a wire dict per
        sequence (stage.py; {"error": ...} for one that failed), "timing": {"engine_s", "read_s"}}."""
        from vllm import SamplingParams

        start = time.perf_counter()
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        runs = await asyncio.gather(*(self._run(ids, greedy) for ids in batch), return_exceptions=True)
        engine_s = time.perf_counter() - start
        items = await asyncio.to_thread(self._read_all, runs)  # the file locks may block: off the event loop
        return {"items": items, "timing": {"engine_s": engine_s, "read_s": time.perf_counter() - start - engine_s}}

    def _read_all(self, runs: list) -> list[dict]:
        return [{"error": repr(run)} if isinstance(run, BaseException) else self._read(run[1]) for run in runs]

    @staticmethod
    def _read(path: str | None) -> dict:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        from peagle_ray.capture.pipeline import as_array, dtype_name

        if path is None:
            return {"error": "the engine returned no hidden_states_path; is the connector configured?"}
        try:
            data = load_hidden_states(path)
        finally:
            cleanup_hidden_states(path)
        hidden = data["hidden_states"]
        return {
            "hidden_states": as_array(hidden),  # the target's dtype, bfloat16 as its bit pattern
            "token_ids": data["token_ids"].numpy(),
            "non_finite": int((~torch.isfinite(hidden)).sum()),
            "dtype": dtype_name(hidden.dtype),
        }

    def storage_files(self) -> list[str]:
        """Files the connector left behind (for tests: should be none after each call)."""
        import os

        return sorted(os.listdir(self.storage_dir))

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        shutil.rmtree(getattr(self, "storage_dir", ""), ignore_errors=True)


def engine_spec(cfg: PeagleConfig, target_dir, num_target_layers: int) -> EngineSpec:
    """Aux layers from config (default: the paper's 2, L/2, L-1) followed by the last layer L."""
    from peagle_ray.target import read_target_info

    aux = read_target_info(target_dir).aux_layer_ids(cfg.capture.aux_layer_ids)
    if max(aux) >= num_target_layers:
        raise ValueError(f"capture.aux_layer_ids must be below the target's {num_target_layers} layers; got {aux}")
    layer_ids = list(aux) + [num_target_layers]
    on_gpu = cfg.capture.num_gpus > 0
    args = engine_args(cfg, target_dir, on_gpu, capture_speculative_config(layer_ids))
    return EngineSpec(args, on_gpu, len(layer_ids))


def start_target_server(cfg: PeagleConfig, target_dir, num_target_layers: int):
    """Deploy the target (blocking until ready) and return its handle. Ray must be initialised."""
    spec = engine_spec(cfg, target_dir, num_target_layers)
    env = target_engine_env(cfg.target, {}, spec.on_gpu)  # only the engine settings, not this process's environment
    # On CPU the engine uses the cores regardless; reserving them would starve the Ray Data actors on a
    # small machine, so the replica claims none. On GPU it claims capture.num_gpus.
    options = {"num_cpus": 0, "num_gpus": cfg.capture.num_gpus, "runtime_env": {"env_vars": env}}
    app = TargetServer.options(  # type: ignore[attr-defined]  # @serve.deployment made it a Deployment
        num_replicas=cfg.capture.num_replicas,
        max_replicas_per_node=cfg.capture.max_replicas_per_node,
        ray_actor_options=options,
    ).bind(spec)
    # the endpoint's options, so that it need not restart Serve later; a running Serve (an endpoint's) is kept
    ensure_serve_http(cfg.serving.host, cfg.serving.port, replace=False)
    return serve.run(app, name=APP_NAME, route_prefix=None)


def stop_target_server() -> None:
    serve.delete(APP_NAME)
