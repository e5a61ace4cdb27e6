"""A sequence's inputs moved to the device in one copy: every tensor of its step (token ids, hidden states,
and the host-side bookkeeping of each segment) packed byte for byte into one buffer, pinned on a GPU,
copied once without blocking, and read on the device as views of that one buffer. The training step then
neither copies per segment nor waits on a pageable copy.

e.g. to_device((tokens int64 (5,), hidden bfloat16 (5, 4)), cuda) -> one 80-byte copy (each tensor starts on
a 16-byte boundary: 40 + 40 bytes), returned as (tokens, hidden) views on the GPU.

Tensors are found in tuples, lists and (frozen) dataclasses, and put back in the same structure. On the CPU
nothing is copied: the structure is returned as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

ALIGN = 16  # bytes: every dtype's view of the buffer starts aligned
T = TypeVar("T")


def to_device(inputs: T, device: torch.device) -> T:
    """`inputs` with each tensor replaced by its copy on `device`, all of them made by one host-to-device copy."""
    if device.type == "cpu":
        return inputs
    buffer, unpack = pack(inputs, pin=device.type == "cuda")
    return unpack(buffer.to(device, non_blocking=True))


def pack(inputs: T, pin: bool = False) -> tuple[torch.Tensor, Callable[[torch.Tensor], T]]:
    """(the bytes of every tensor of `inputs` in one uint8 buffer, pinned where `pin`; the function that
    rebuilds `inputs` from that buffer, or from its copy on any device, as views of it)."""
    tensors = list(_tensors(inputs))
    starts, size = [], 0
    for tensor in tensors:
        starts.append(size)
        size += -(-_nbytes(tensor) // ALIGN) * ALIGN
    buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    for tensor, start in zip(tensors, starts, strict=True):
        buffer[start : start + _nbytes(tensor)].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
    layout = [(start, _nbytes(t), t.dtype, t.shape) for t, start in zip(tensors, starts, strict=True)]

    def unpack(copied: torch.Tensor) -> T:
        views = (copied[start : start + nbytes].view(dtype).view(shape) for start, nbytes, dtype, shape in layout)
        return _rebuilt(inputs, views)

    return buffer, unpack


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.init:
                yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, tuple | list):
        for item in obj:
            yield from _tensors(item)


def _rebuilt(obj: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """`obj` with its tensors, in _tensors' order, taken from `tensors`."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _rebuilt(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple | list):
        return type(obj)(_rebuilt(item, tensors) for item in obj)
    return obj
