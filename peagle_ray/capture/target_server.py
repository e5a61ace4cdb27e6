"""The target in Ray Serve: one vLLM engine that regenerates responses and captures hidden states.

The engine runs vLLM's `extract_hidden_states` speculative method with a hidden-states connector (ours on
CPU, vLLM's stock one on GPU). A capture request is a 1-token generation over the full conversation: the
connector writes the hidden states of every prompt position to a file on the replica's node; the replica
reads it, deletes it (and its lock), and returns the tensors through Ray's object store, so capture works
across nodes without a shared filesystem.

    handle = start_target_server(cfg, target_dir)          # serve.run, no HTTP route
    handle.capture.remote(input_ids).result()             # {"hidden_states": (T, n_layers, H), "token_ids": (T,)}
    handle.generate.remote(prompt_ids, max_tokens, temperature).result()   # generated token ids
    stop_target_server()
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from dataclasses import dataclass

import torch
from ray import serve

from peagle_ray.config import PeagleConfig
from peagle_ray.engine import target_engine_env

APP_NAME = "peagle-target"
CPU_CONNECTOR = ("CPUHiddenStatesConnector", "peagle_ray.capture.connector")
GPU_CONNECTOR = ("ExampleHiddenStatesConnector", None)


@dataclass(frozen=True)
class EngineSpec:
    """What the replica needs to build its engine; plain data so it travels to any node."""

    target_dir: str
    dtype: str
    max_model_len: int
    layer_ids: list[int]  # aux layers then the last layer (L): what the connector captures, in order
    trust_remote_code: bool
    seed: int = 0


def engine_kwargs(spec: EngineSpec, storage_dir: str, use_gpu: bool) -> dict:
    connector, module = GPU_CONNECTOR if use_gpu else CPU_CONNECTOR
    kv_transfer = {
        "kv_connector": connector,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_dir},
    }
    if module:
        kv_transfer["kv_connector_module_path"] = module
    return dict(
        model=spec.target_dir,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        enforce_eager=not use_gpu,  # CPU: skip long compiles
        trust_remote_code=spec.trust_remote_code,
        seed=spec.seed,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": spec.layer_ids}},
        },
        kv_transfer_config=kv_transfer,
    )


@serve.deployment(name="TargetServer", max_ongoing_requests=64)
class TargetServer:
    def __init__(self, spec: EngineSpec):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.storage_dir = tempfile.mkdtemp(prefix="peagle-hidden-")
        args = AsyncEngineArgs(**engine_kwargs(spec, self.storage_dir, torch.cuda.is_available()))
        self.engine = AsyncLLM.from_engine_args(args)
        self.num_layers = len(spec.layer_ids)

    async def _run(self, token_ids: list[int], sampling) -> tuple[list[int], str | None]:
        from vllm.inputs import TokensPrompt

        final = None
        async for output in self.engine.generate(TokensPrompt(prompt_token_ids=token_ids), sampling, uuid.uuid4().hex):
            final = output
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

    async def capture(self, input_ids: list[int]) -> dict[str, torch.Tensor]:
        """Hidden states of every position of `input_ids`: (T, n_layers, H), plus the token ids seen."""
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        _, path = await self._run(input_ids, SamplingParams(max_tokens=1, temperature=0.0))
        if path is None:
            raise RuntimeError("the engine returned no hidden_states_path; is the connector configured?")
        try:
            data = load_hidden_states(path)
        finally:
            cleanup_hidden_states(path)
        return {"hidden_states": data["hidden_states"], "token_ids": data["token_ids"]}

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

    aux = cfg.capture.aux_layer_ids or read_target_info(target_dir).default_aux_layer_ids()
    if max(aux) >= num_target_layers:
        raise ValueError(f"capture.aux_layer_ids must be below the target's {num_target_layers} layers; got {aux}")
    return EngineSpec(
        str(target_dir),
        cfg.target.dtype,
        cfg.target.max_model_len,
        list(aux) + [num_target_layers],
        cfg.target.trust_remote_code,
        cfg.training.seed,
    )


def start_target_server(cfg: PeagleConfig, target_dir, num_target_layers: int):
    """Deploy the target (blocking until ready) and return its handle. Ray must be initialised."""
    spec = engine_spec(cfg, target_dir, num_target_layers)
    env = target_engine_env(cfg.target, {})  # only the engine settings, not this process's environment
    # On CPU the engine uses the cores regardless; reserving them would starve the Ray Data actors on a
    # small machine, so the replica claims none. On GPU it claims one GPU.
    options = {"num_cpus": 0, "num_gpus": 1 if cfg.training.use_gpu else 0, "runtime_env": {"env_vars": env}}
    app = TargetServer.options(ray_actor_options=options).bind(spec)
    return serve.run(app, name=APP_NAME, route_prefix=None)


def stop_target_server() -> None:
    serve.delete(APP_NAME)
