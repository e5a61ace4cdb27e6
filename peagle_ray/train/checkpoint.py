"""Training checkpoints: what a worker saves at each validation (weights, optimizer, scheduler, COD generator,
state), what resumes from it, and `peagle-ray export` of one into the speculators format.

    <checkpoint>/drafter.safetensors   the drafter's weights
    <checkpoint>/optimizer.pt          optimizer, scheduler and generator state (tensors and numbers only)
    <checkpoint>/state.json            step, best AL, the arch, and what a standalone export needs
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from peagle_ray.drafter.model import Drafter, DrafterArch

CHECKPOINT_WEIGHTS = "drafter.safetensors"
CHECKPOINT_OPTIMIZER = "optimizer.pt"
CHECKPOINT_STATE = "state.json"


def save_checkpoint(directory: Path, drafter, optimizer, scheduler, generator, state: dict) -> None:
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(directory / CHECKPOINT_WEIGHTS))
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "generator": generator.get_state()},
        directory / CHECKPOINT_OPTIMIZER,
    )
    (directory / CHECKPOINT_STATE).write_text(json.dumps({**state, "arch": json.loads(drafter.arch.to_json())}))


def drafter_weights(directory: Path, drafter) -> dict:
    """A checkpoint's drafter tensors; one written before feature_scale existed gets the identity scale."""
    weights = load_file(str(directory / CHECKPOINT_WEIGHTS))
    weights.setdefault("feature_scale", torch.ones_like(drafter.feature_scale))
    return weights


def load_checkpoint(directory: Path, drafter, optimizer, scheduler, generator) -> dict:
    drafter.load_state_dict(drafter_weights(directory, drafter))
    extra = torch.load(directory / CHECKPOINT_OPTIMIZER, weights_only=True)  # tensors and numbers only
    optimizer.load_state_dict(extra["optimizer"])
    scheduler.load_state_dict(extra["scheduler"])
    generator.set_state(extra["generator"])
    return json.loads((directory / CHECKPOINT_STATE).read_text())


def load_drafter_from_checkpoint(directory: Path):
    """The drafter saved in a training checkpoint directory."""
    arch = DrafterArch(**json.loads((directory / CHECKPOINT_STATE).read_text())["arch"])
    drafter = Drafter(arch)
    drafter.load_state_dict(drafter_weights(directory, drafter))
    return drafter


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, num_speculative_tokens: int | None = None) -> Path:
    """`peagle-ray export`: export a training checkpoint directory to the speculators format vLLM loads."""
    from peagle_ray.export.speculators import export_drafter

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / CHECKPOINT_STATE).is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a peagle-ray training checkpoint (no {CHECKPOINT_STATE})")
    state = json.loads((checkpoint_dir / CHECKPOINT_STATE).read_text())
    drafter = load_drafter_from_checkpoint(checkpoint_dir)
    return export_drafter(
        drafter,
        out_dir,
        Path(state["target_dir"]),
        state["aux_layer_ids"],
        num_speculative_tokens or state["num_speculative_tokens"],
        state["max_model_len"],
        {"checkpoint": str(checkpoint_dir), "step": state["step"]},
    )
