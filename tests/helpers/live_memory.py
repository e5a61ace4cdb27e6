"""Peak bytes of live tensor storages while code runs: on CPU the measure torch.cuda.max_memory_allocated
gives on a GPU (the allocator's live bytes), without the Python runtime, libraries or allocator slack that a
process's RSS adds."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """with LiveTensorBytes(existing) as m: ...; m.peak counts the storages of `existing` (parameters,
    optimizer state, inputs made before) and of every tensor an operator returns, each once, until freed."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        for tensor in existing:
            self._add(tensor)
        self.peak = self.now

    def _add(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self._add(tensor)
        self.peak = max(self.peak, self.now)
        return out
