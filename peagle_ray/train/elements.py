"""Training sequences and their elements; COD (conditional drop-token) sampling.

Shape legend: T tokens in a captured record, N = T - 1 positions, E elements, H target hidden size,
A = n_aux * H concatenated aux hidden size.

Positions. A record holds token ids x_0..x_{T-1} and the target's hidden states h_0..h_{T-1} (h_t has seen
x_0..x_t). As in vLLM's EAGLE drafter, position p pairs the *next* token x_{p+1} with h_p; the drafter there
predicts x_{p+2}, whose target distribution comes from the target's last hidden state at p+1.

Elements (anchor a, depth d) and their worked example: drafter/elements.py.

COD keeps, at depth d, a fraction max(keep_ratio**d, min_ratio) of the supervised positions, drawn only among
chains that kept depth d-1, whose position a + d is supervised and in the same document. With 0.7 / 0.2
the flattened length is about N * (1 + 0.7 + 0.49 + 0.34) = 2.5 N for K = 4 and 3.4 N for K = 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_ray.drafter.elements import Elements


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence (one or several packed documents), already shifted to positions."""

    tokens: torch.Tensor  # (N,) long: token fed at position p, i.e. x_{p+1}
    hidden: torch.Tensor  # (N, A): target aux hidden states h_p, concatenated over aux layers
    teacher_hidden: torch.Tensor  # (N, H): target last-layer (pre-norm) hidden at p+1
    supervised: torch.Tensor  # (N,) bool: the token predicted after position p is trained on
    doc_ids: torch.Tensor  # (N,) long: document of each position; attention never crosses documents

    def __post_init__(self):
        n = self.tokens.shape[0]
        for name in ("hidden", "teacher_hidden", "supervised", "doc_ids"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(
                    f"TrainSequence.{name} must have {n} rows (one per position); got {getattr(self, name).shape[0]}"
                )

    @property
    def num_positions(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def from_record(input_ids, loss_mask, aux_hidden, last_hidden, doc_id: int = 0) -> TrainSequence:
        """Shift one captured record (T tokens) to N = T - 1 positions.

        Position p gets token x_{p+1}, aux hidden h_p, teacher hidden last_{p+1}; it is supervised when the
        token it predicts, x_{p+2}, is a loss-masked (assistant) token. For T = 5, loss_mask = [0,0,1,1,1]:
        tokens = x_1..x_4, supervised = [1, 1, 1, 0] (position 3 would predict x_5, past the end).
        """
        t = input_ids.shape[0]
        if t < 2:
            raise ValueError(f"a record needs at least 2 tokens to make a training position; got {t}")
        supervised = torch.zeros(t - 1, dtype=torch.bool)
        supervised[: t - 2] = loss_mask[2:].bool()
        return TrainSequence(
            tokens=input_ids[1:].long(),
            hidden=aux_hidden[:-1],
            teacher_hidden=last_hidden[1:],
            supervised=supervised,
            doc_ids=torch.full((t - 1,), doc_id, dtype=torch.long),
        )

    @staticmethod
    def pack(sequences: list[TrainSequence]) -> TrainSequence:
        """Concatenate documents into one sequence; each keeps its own document id."""
        return TrainSequence(
            tokens=torch.cat([s.tokens for s in sequences]),
            hidden=torch.cat([s.hidden for s in sequences]),
            teacher_hidden=torch.cat([s.teacher_hidden for s in sequences]),
            supervised=torch.cat([s.supervised for s in sequences]),
            doc_ids=torch.cat([torch.full_like(s.doc_ids, i) for i, s in enumerate(sequences)]),
        )


def cod_keep_fraction(depth: int, keep_ratio: float, min_ratio: float) -> float:
    """Share of supervised positions kept at `depth`: 1 at depth 0, then max(keep_ratio**d, min_ratio)."""
    return 1.0 if depth == 0 else max(keep_ratio**depth, min_ratio)


def cod_sample(
    supervised: torch.Tensor,
    doc_ids: torch.Tensor,
    num_depths: int,
    keep_ratio: float,
    min_ratio: float,
    generator: torch.Generator,
) -> Elements:
    """COD sampling over N positions; returns elements depth-major (all depth 0, then depth 1, ...).

    Depth 0 holds every position (they are the context every element attends to). At depth d >= 1,
    round(fraction(d) * #supervised) chains are drawn uniformly without replacement from the candidates:
    chains that kept depth d-1, with a + d < N, supervised[a + d] and doc_ids[a + d] == doc_ids[a].
    """
    n = supervised.shape[0]
    budget = int(supervised.sum())
    anchors = torch.arange(n)
    parts = [Elements(anchors, torch.zeros(n, dtype=torch.long))]
    alive = anchors  # chains that kept the previous depth
    for d in range(1, num_depths):
        pos = alive + d
        inside = pos < n
        alive, pos = alive[inside], pos[inside]
        candidates = alive[supervised[pos] & (doc_ids[pos] == doc_ids[alive])]
        count = min(round(cod_keep_fraction(d, keep_ratio, min_ratio) * budget), len(candidates))
        pick = torch.randperm(len(candidates), generator=generator)[:count]
        alive = candidates[pick].sort().values
        if len(alive) == 0:
            break
        parts.append(Elements(alive, torch.full_like(alive, d)))
    return Elements.cat(parts)
