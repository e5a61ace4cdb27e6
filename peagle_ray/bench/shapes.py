"""Drafter shapes used by the benchmarks: SmolLM2-135M's by default, or any target directory's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from peagle_ray.config import DrafterConfig
from peagle_ray.drafter.build import arch_from_target
from peagle_ray.drafter.model import Algorithm, Drafter, DrafterArch
from peagle_ray.drafter.teacher import Teacher
from peagle_ray.target import LLAMA3_ROPE, read_target_info
from peagle_ray.train.elements import TrainSequence

# SmolLM2-135M-Instruct's shape (from the embedded target's config.json), kept here so the shape benchmarks
# (train-memory, draft-latency, mask) run without converting the target first; `bench draft-latency --target
# DIR` reads a prepared target's config.json instead (bench_arch(target=...)).
SMOLLM2_SHAPE: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)


# The drafter shapes of released targets (config.json's width, heads and vocabulary; bench step-table)
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": SMOLLM2_SHAPE,
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "llama3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
        rms_norm_eps=1e-5,
    ),
    # the CPU rehearsal (tests/test_gpu_check.py): odd, tiny, flex's fused kernel wants head_dim >= 16
    "tiny": dict(
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=1031,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    ),
}


def bench_arch(
    algorithm: Algorithm, num_depths: int, draft_vocab_size: int | None, num_layers: int = 1, target: Path | None = None
) -> DrafterArch:
    """A drafter arch with the SmolLM2 shape (or `target`'s), 3 aux layers, mask token = last row."""
    if target is not None:
        cfg = DrafterConfig(algorithm=algorithm, num_depths=num_depths, num_layers=num_layers)
        return arch_from_target(target, cfg, draft_vocab_size, read_target_info(target).vocab_size - 1, 3)
    vocab = SMOLLM2_SHAPE["vocab_size"]
    return DrafterArch(
        algorithm=algorithm,
        num_depths=num_depths,
        num_layers=num_layers,
        num_aux=3,
        draft_vocab_size=draft_vocab_size or vocab,
        mask_token_id=vocab - 1 if algorithm == "peagle" else None,
        **SMOLLM2_SHAPE,
    )


def shape_arch(
    shape: str, depths: int, draft_vocab_size: int, layers: int, algorithm: Algorithm = "peagle"
) -> DrafterArch:
    """A drafter arch at SHAPES[shape], 3 aux layers, the draft vocabulary capped at the target's, the mask
    token (P-EAGLE) its last row."""
    fields = SHAPES[shape]
    return DrafterArch(
        algorithm=algorithm,
        num_depths=depths,
        num_layers=layers,
        num_aux=3,
        draft_vocab_size=min(draft_vocab_size, fields["vocab_size"]),
        mask_token_id=fields["vocab_size"] - 1 if algorithm == "peagle" else None,
        **fields,
    )


def random_drafter(arch: DrafterArch, seed: int = 0) -> tuple[Drafter, Teacher]:
    """Random weights at a realistic scale (timing and memory do not depend on the values)."""
    g, std = torch.Generator().manual_seed(seed), DrafterConfig().init_std
    drafter = Drafter(arch)
    with torch.no_grad():
        for param in drafter.parameters():
            if param.ndim >= 2 or param.shape[-1] == arch.num_aux * arch.hidden_size:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    teacher = Teacher(
        torch.ones(arch.hidden_size),
        torch.randn(arch.draft_vocab_size, arch.hidden_size, generator=g) * std,
        arch.rms_norm_eps,
    )
    return drafter, teacher


def random_sequence(arch: DrafterArch, n: int, generator: torch.Generator) -> TrainSequence:
    """n positions of random tokens and hidden states of arch's shape, every position supervised."""
    t = n + 1
    seq = TrainSequence.from_record(
        torch.randint(0, arch.vocab_size - 1, (t,), generator=generator),
        torch.ones(t),
        torch.randn(t, arch.num_aux * arch.hidden_size, generator=generator),
        torch.randn(t, arch.hidden_size, generator=generator),
    )
    return TrainSequence(seq.tokens, seq.hidden, seq.teacher_hidden, torch.ones(n, dtype=torch.bool), seq.doc_ids)
