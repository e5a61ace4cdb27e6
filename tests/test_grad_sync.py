"""The Ray Train job's gradient sync is torch DDP around SegmentLoss (ray.train.torch.prepare_model): two
gloo processes, each accumulating its sequences' segment backward passes and syncing only in its last, end
with the mean of what one process computes for all of them - also when a worker's last backward leaves the
mask parameter unused (a segment of depth-0 elements only) and when its last sequence trains nothing."""

import pytest
import torch
import torch.distributed as dist

from peagle_ray.serve.app import free_port
from peagle_ray.train.elements import cod_sample
from peagle_ray.train.step import SegmentLoss, sequence_backward
from tests.drafter_helpers import random_sequence, tiny_arch, tiny_drafter

pytestmark = pytest.mark.slow  # two processes

K = 4
# per worker, its step's sequences: (document lengths, seed, first supervised token, segment boundaries)
BATCHES = [
    [([14, 9], 1, 2, None), ([12], 2, 2, [0, 6, 10, 11])],  # the last segment: the last position, depth 0 only
    [([16], 3, 2, [0, 8, 15]), ([5], 4, 5, None)],  # the last sequence supervises nothing
]


def sequences(rank: int):
    for lengths, seed, supervised_from, boundaries in BATCHES[rank]:
        seq = random_sequence(lengths, seed=seed, supervised_from=supervised_from)
        elements = cod_sample(seq.supervised, seq.doc_ids, K, 0.7, 0.2, torch.Generator().manual_seed(seed))
        yield seq, elements, boundaries


def grads(drafter) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    drafter, teacher = tiny_drafter(tiny_arch("peagle", num_depths=K))
    options = {"find_unused_parameters": True, "forward_sync_buffers": False}  # the job's (train/worker.py)
    ddp = torch.nn.parallel.DistributedDataParallel(SegmentLoss(drafter), **options)
    batch = list(sequences(rank))
    for _step in range(2):  # a second step: DDP refuses one after a step that left a reduction unfinished
        drafter.zero_grad(set_to_none=True)
        for n, (seq, elements, boundaries) in enumerate(batch):
            last = n == len(batch) - 1
            sequence_backward(
                drafter, teacher, seq, elements, 10**6, None, 0.5, boundaries=boundaries, loss_module=ddp, sync=last
            )
    torch.save(grads(drafter), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_ddp_over_segments_equals_one_process_over_all_sequences(tmp_path):
    drafter, teacher = tiny_drafter(tiny_arch("peagle", num_depths=K))
    for rank in (0, 1):
        for seq, elements, boundaries in sequences(rank):
            sequence_backward(drafter, teacher, seq, elements, 10**6, None, 0.25, boundaries=boundaries)
    expected = grads(drafter)
    assert expected["mask_hidden"].abs().sum() > 0  # used by earlier segments, not by rank 0's last backward

    torch.multiprocessing.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], msg=f"{name} on rank {rank}")
