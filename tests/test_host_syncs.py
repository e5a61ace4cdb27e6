"""The training step without host stalls, checked without a GPU (issue 48's proxy): the step on the meta device
under bench/host_syncs.py's counter reads the device once per step and copies each sequence's inputs in once;
the one-copy packing (train/transfer.py) and the host-side loss plan (train/loss.py LossPlan) exactly."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from peagle_ray.bench.host_syncs import HostSyncs, count_step
from peagle_ray.drafter.elements import Elements
from peagle_ray.drafter.model import depth_bounds_of
from peagle_ray.train.loss import loss_plan
from peagle_ray.train.transfer import ALIGN, pack, to_device


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_a_training_step_reads_the_device_once_and_copies_each_sequence_in_once(algorithm):
    counted = count_step(algorithm, "tiny", sequences=2, seq_len=32, segment_length=16, depths=3)
    assert counted["segments"] >= 2 * 3  # the loop runs segment after segment...
    assert counted["reads_per_step"] <= 2  # ...and the step's stats and gradient norm come back in one read
    assert counted["reads_per_step"] == 1
    assert counted["copies_in_per_step"] == 2  # one packed copy per sequence, none per segment


def test_the_counter_sees_reads_and_copies_on_the_meta_device():
    x = torch.ones(4, device="meta")
    with HostSyncs() as counter:
        float(x.sum()), x.tolist(), x.cpu(), bool(x.any())
        torch.ones(4).to("meta")
        torch.ones(4).to("cpu")  # host to host: no copy in
    assert (counter.reads, counter.copies_in) == (4, 1)


def test_a_value_dependent_shape_cannot_hide_on_the_meta_device():
    x = torch.ones(4, device="meta")
    with HostSyncs(), pytest.raises(NotImplementedError):  # boolean indexing needs nonzero: a sync on a GPU
        x[x > 0].sum()


@dataclass(frozen=True)
class Pair:
    left: torch.Tensor
    right: Elements
    label: str


def test_one_buffer_carries_every_tensor_back_exactly():
    inputs = (
        torch.arange(5),
        torch.randn(5, 3).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        [Pair(torch.zeros(0), Elements(torch.tensor([2, 0]), torch.tensor([1, 1])), "kept")],
        7,
    )
    buffer, unpack = pack(inputs)
    # 40 bytes of int64 take 48 (16-byte steps), 30 of bfloat16 32, 3 of bool 16, an empty tensor none
    assert buffer.dtype == torch.uint8 and len(buffer) == 48 + 32 + 16 + 0 + 16 + 16
    assert len(buffer) % ALIGN == 0
    out = unpack(buffer.clone())
    assert out[4] == 7 and out[3][0].label == "kept"
    for before, after in [(inputs[i], out[i]) for i in range(3)] + [
        (inputs[3][0].left, out[3][0].left),
        (inputs[3][0].right.anchor, out[3][0].right.anchor),
        (inputs[3][0].right.depth, out[3][0].right.depth),
    ]:
        assert after.dtype == before.dtype and after.shape == before.shape and torch.equal(after, before)


def test_to_device_copies_nothing_on_the_cpu_and_once_elsewhere():
    inputs = (torch.arange(5), [torch.ones(2, 2)])
    assert to_device(inputs, torch.device("cpu")) is inputs
    with HostSyncs() as counter:
        moved = to_device(inputs, torch.device("meta"))
    assert counter.copies_in == 1 and moved[1][0].is_meta and moved[1][0].shape == (2, 2)


def test_the_loss_plan_of_the_docstring_example():
    plan = loss_plan(torch.tensor([5, 3, 5, 9]), chunk=2)
    assert plan.used.tolist() == [3, 5, 9]
    assert plan.order.tolist() == [1, 0, 2, 3]
    assert plan.chunk_positions.tolist() == [0, 1, 1, 2]
    assert plan.chunk_sizes == (2, 2)
    assert plan.of_row.tolist() == [0, 1, 0, 1]


def test_depth_bounds_of_depth_major_elements():
    assert depth_bounds_of(torch.tensor([0, 0, 0, 1, 1, 2])) == [0, 3, 5, 6]
