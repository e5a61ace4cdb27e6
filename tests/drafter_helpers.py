"""Tiny odd-sized drafters and sequences built from explicit generators (no target directory needed)."""

import torch

from peagle_ray.drafter.model import Drafter, DrafterArch
from peagle_ray.drafter.teacher import Teacher
from peagle_ray.train.elements import TrainSequence

VOCAB, DRAFT_VOCAB, HIDDEN, NUM_AUX = 37, 29, 24, 3


def tiny_arch(algorithm: str = "peagle", num_layers: int = 1, num_depths: int = 3, **overrides) -> DrafterArch:
    fields = dict(
        algorithm=algorithm,
        num_depths=num_depths,
        num_layers=num_layers,
        hidden_size=HIDDEN,
        intermediate_size=40,
        num_heads=3,
        num_kv_heads=1,
        head_dim=8,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        num_aux=NUM_AUX,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        mask_token_id=VOCAB - 1 if algorithm == "peagle" else None,
    )
    fields.update(overrides)
    return DrafterArch(**fields)


def tiny_drafter(arch: DrafterArch, seed: int = 0, dtype=torch.float64) -> tuple[Drafter, Teacher]:
    g = torch.Generator().manual_seed(seed)
    drafter = Drafter(arch)
    with torch.no_grad():
        for param in drafter.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3 + (1.0 if param.ndim == 1 else 0.0))
        drafter.d2t.copy_(torch.tensor([0] * 20 + [3] * (DRAFT_VOCAB - 20)))  # draft ids 20.. -> target 23..
    teacher = Teacher(1 + 0.1 * torch.randn(HIDDEN, generator=g), torch.randn(DRAFT_VOCAB, HIDDEN, generator=g), 1e-6)
    return drafter.to(dtype), teacher.to(dtype)


def random_sequence(lengths: list[int], seed: int = 0, dtype=torch.float64, supervised_from: int = 2) -> TrainSequence:
    """Packed documents of the given token lengths, random hidden states, first tokens unsupervised."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i, t in enumerate(lengths):
        loss_mask = torch.zeros(t, dtype=torch.bool)
        loss_mask[supervised_from:] = True
        docs.append(
            TrainSequence.from_record(
                torch.randint(0, VOCAB - 1, (t,), generator=g),
                loss_mask,
                torch.randn(t, NUM_AUX * HIDDEN, generator=g, dtype=dtype),
                torch.randn(t, HIDDEN, generator=g, dtype=dtype),
                doc_id=i,
            )
        )
    return TrainSequence.pack(docs)
