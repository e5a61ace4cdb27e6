"""`peagle-ray bench host-syncs`: how often one training step would make a GPU's host wait, counted without a
GPU. The step runs on PyTorch's meta device (shapes, no values) under a dispatch mode (HostSyncs) that counts
what stalls a GPU step: reads of a device value by the host (`.item()`, `float()`, `int()`, a tensor's truth
value, `.tolist()`, `.cpu()`) and host-to-device copies. An op whose output shape depends on device values
(`nonzero`, `unique`, boolean indexing) cannot run on meta at all: the step fails there, naming the op, as
such an op would stall the GPU. The same proxy CI holds (tests/test_host_syncs.py: at most 2 reads per step,
one input copy per sequence); on a GPU, the profiler's count of stream synchronizations is the real measure
(docs/gpu_profile_step_*).

e.g. one step of 2 sequences in 30 segments before the host-side bookkeeping (train/step.py plan_segments):
88 reads, 14 nonzero, 14 unique, 14 unique_consecutive, 72 boolean indexings and 3 copies per segment;
after: 1 read and 1 copy per sequence.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peagle_ray.drafter.model import Algorithm
from peagle_ray.options import Opt

aten = torch.ops.aten


class HostSyncs(TorchDispatchMode):
    """Counts, for tensors on the meta device: `reads` (a device value read by the host: _local_scalar_dense,
    or a copy to the CPU; each answered with zeros) and `copies_in` (host-to-device copies)."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.copies_in = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and args[0].is_meta:
            self.reads += 1
            return False if args[0].dtype == torch.bool else 0
        if func is aten._to_copy.default and "device" in kwargs:
            source, target = args[0].device, torch.device(kwargs["device"])
            if source.type == "meta" and target.type == "cpu":
                self.reads += 1
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            self.copies_in += source.type == "cpu" and target.type == "meta"
        if func is aten.copy_.default:
            target, source = args[0].device, args[1].device
            if source.type == "meta" and target.type == "cpu":
                self.reads += 1
                return args[0]
            self.copies_in += source.type == "cpu" and target.type == "meta"
        return func(*args, **kwargs)


def count_step(
    algorithm: Algorithm = "peagle",
    shape: str = "tiny",
    sequences: int = 2,
    seq_len: int = 256,
    segment_length: int = 64,
    depths: int = 4,
) -> dict[str, Any]:
    """One train_step of `sequences` random sequences of `seq_len` positions (two documents each) on the meta
    device, at drafter shape `shape` (bench/shapes.py SHAPES): its reads, copies and segments. Counted at the
    second step: the first also moves what stays on the device (each attention's rotary frequencies)."""
    from peagle_ray.bench.shapes import random_sequence, shape_arch
    from peagle_ray.config import PeagleConfig, with_values
    from peagle_ray.drafter.model import Drafter
    from peagle_ray.drafter.teacher import Teacher
    from peagle_ray.train.elements import TrainSequence
    from peagle_ray.train.step import make_optimizer, train_step

    arch = shape_arch(shape, depths, 32768, 1, algorithm)
    cfg = with_values(
        PeagleConfig(),
        {"drafter.algorithm": algorithm, "drafter.num_depths": depths, "training.segment_length": segment_length,
         "training.sequences_per_step": sequences},
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        drafter = Drafter(arch)
        teacher = Teacher(torch.ones(arch.hidden_size), torch.zeros(arch.draft_vocab_size, arch.hidden_size), 1e-6)
    optimizer, scheduler = make_optimizer(drafter, cfg.training)
    halves = (seq_len // 2, seq_len - seq_len // 2)  # two documents per sequence
    batch = [TrainSequence.pack([random_sequence(arch, n, g) for n in halves]) for _ in range(sequences)]
    with HostSyncs():  # (its reads answered: meta tensors hold no values)
        train_step(drafter, teacher, optimizer, scheduler, batch, cfg.drafter, cfg.training, g)  # moves what stays
    counter = HostSyncs()
    with counter:  # the steady state: the second step
        stats = train_step(drafter, teacher, optimizer, scheduler, batch, cfg.drafter, cfg.training, g)
    return {
        "algorithm": algorithm,
        "shape": shape,
        "sequences": sequences,
        "seq_len": seq_len,
        "segments": stats.segments,
        "elements": stats.elements,
        "reads_per_step": counter.reads,
        "copies_in_per_step": counter.copies_in,
    }


def run(
    shape: Annotated[str, Opt("Drafter shape (bench/shapes.py SHAPES), e.g. tiny, smollm2, qwen3-8b.")] = "tiny",
    sequences: Annotated[int, Opt("Sequences per step.")] = 2,
    seq_len: Annotated[int, Opt("Positions per sequence.")] = 256,
    segment_length: Annotated[int, Opt("Elements per partition segment.")] = 64,
    depths: Annotated[int, Opt("K: parallel drafting depth.")] = 4,
    progress=print,
) -> dict:
    """Both algorithms' counts: P-EAGLE (the step train_step runs) and EAGLE-3's training-time test."""
    rows = []
    algorithms: tuple[Algorithm, ...] = ("peagle", "eagle3")
    for algorithm in algorithms:
        rows.append(count_step(algorithm, shape, sequences, seq_len, segment_length, depths))
        progress(str(rows[-1]))
    return {"rows": rows}
