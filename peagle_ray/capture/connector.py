"""A CPU-capable hidden-states connector for vLLM's `extract_hidden_states` speculative method.

vLLM's ExampleHiddenStatesConnector copies the captured hidden states off the GPU with CUDA streams, events
and pinned memory, which fail on a CPU-only engine. This subclass replaces only that step with a
synchronous gather and write; file layout, locking and the scheduler side stay vLLM's own. It is loaded
through vLLM's extension point:

    kv_transfer_config = {"kv_connector": "CPUHiddenStatesConnector",
                          "kv_connector_module_path": "peagle_ray.capture.connector", ...}

Each finished request leaves `<storage>/<request id>.safetensors` with {hidden_states: (T, n_layers, H),
token_ids: (T,)} and a `.lock` file (see vLLM's load_hidden_states / cleanup_hidden_states).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """Stands in for the CUDA event the stock connector polls: the write already happened."""

    @staticmethod
    def query() -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slot_mapping = (blocks[:, None] * self._block_size + torch.arange(self._block_size)[None, :]).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the exclusive lock readers wait on
        self._req_copy_events[pending.req_id] = _Written()
