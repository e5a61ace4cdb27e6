"""Hidden states captured with HF transformers: the reference vLLM capture is tested against, and the
source of synthetic training records for unit tests.

Aux layer id i is HF `hidden_states[i]` (the input of decoder layer i); the last hidden state is the final
decoder layer's output before the final norm (what vLLM's extract_hidden_states returns for id L).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_hidden_states(model, input_ids: torch.Tensor, aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux (T, n_aux * H), last (T, H)) for one sequence `input_ids` (T,)."""
    captured: dict[str, torch.Tensor] = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    try:
        out = model(input_ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    aux = torch.cat([out.hidden_states[i][0] for i in aux_layer_ids], dim=-1)
    return aux, captured["last"][0]
