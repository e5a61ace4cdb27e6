"""The drafter: EAGLE-3 architecture, P-EAGLE parallel drafting, in one file read top to bottom.

Shape legend: E elements (queries), S keys (cached + current), H hidden, A = n_aux * H aux hidden,
V target vocabulary, DV draft vocabulary, nh / nkv attention / KV heads, hd head dim.

Weight names follow the speculators layout vLLM loads (`Eagle3LlamaForCausalLM`), so export is a plain
save: embed_tokens, fc, layers.i.{input_layernorm, hidden_norm (layer 0), self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}, norm, lm_head, mask_hidden, d2t, t2d.

Inputs of one element (anchor a, depth d) at position a + d, as in vLLM's proposer:
    depth 0:             token x_{a+1} (embed_tokens)   hidden fc(aux h_a)
    P-EAGLE depth >= 1:  the mask token                 hidden fc(mask_hidden)    all depths in ONE forward
    EAGLE-3 depth >= 1:  token x_{a+d+1}                hidden = this chain's previous output (pre-norm),
                                                        one forward per depth (training-time test)
Layer 0 sees [input_layernorm(embedding); hidden_norm(hidden)] (2H); later layers see H. The output is
norm(pre-norm hidden) -> lm_head over the draft vocabulary; draft id i means target id i + d2t[i].
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from peagle_ray.drafter.elements import Elements, attention_mask

Algorithm = Literal["peagle", "eagle3"]


@dataclass(frozen=True)
class DrafterArch:
    """Everything that fixes the drafter's tensors. Built by `arch_from_target`, saved with checkpoints."""

    algorithm: Algorithm
    num_depths: int  # K
    num_layers: int
    hidden_size: int  # H, the target's
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # V, the target's embedding rows
    draft_vocab_size: int  # DV
    num_aux: int  # aux layers concatenated into A = num_aux * H
    rope_theta: float
    rms_norm_eps: float
    mask_token_id: int | None  # P-EAGLE only
    norm_before_residual: bool = False
    rope_scaling: dict | None = None
    """The target's rope beyond its base, e.g. Llama-3.1's {"rope_type": "llama3", "factor": 8.0, ...};
    None for plain rope. target.drafter_rope checked it; `rope_parameters` adds rope_theta."""

    def __post_init__(self):
        if self.algorithm not in ("peagle", "eagle3"):
            raise ValueError(f"algorithm must be 'peagle' or 'eagle3'; got {self.algorithm!r}")
        if self.algorithm == "peagle" and self.mask_token_id is None:
            raise ValueError("mask_token_id is required for algorithm 'peagle'; got None")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be in [0, {self.vocab_size}); got {self.mask_token_id}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}; got {self.draft_vocab_size}")
        if self.rope_scaling is not None and "rope_theta" in self.rope_scaling:
            raise ValueError(f"rope_scaling must not repeat rope_theta (a field of its own); got {self.rope_scaling}")

    @property
    def rope_parameters(self) -> dict:
        """The rope as transformers 5 and vLLM read it from a config: {rope_type, rope_theta, ...}."""
        return {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> DrafterArch:
        return DrafterArch(**json.loads(text))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in float32 like HF / vLLM, so bf16 training matches the serving numerics
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_frequencies(arch: DrafterArch) -> tuple[torch.Tensor, float]:
    """(inv_freq (hd/2,) float32, scale of cos and sin) of the arch's rope. Plain rope is theta^(-2i/hd); the
    scaled types (llama3, yarn, linear) come from transformers' own initialisers, the ones HF's Llama uses,
    so the numbers are those of the target's family; yarn's scale is its attention factor (1.0 otherwise)."""
    params = arch.rope_parameters
    if params["rope_type"] == "default":
        exponents = torch.arange(0, arch.head_dim, 2, dtype=torch.float32, device="cpu") / arch.head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # a context as long as the scaling implies (else transformers warns that yarn's factor disagrees with it)
    context = int(params.get("original_max_position_embeddings", 2048) * params.get("factor", 1.0))
    config = LlamaConfig(
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=context,
        rope_parameters=dict(params),
    )
    with torch.device("cpu"):  # real numbers even while a drafter is built on the meta device (a dry run)
        inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Rotary embedding (HF/vLLM neox layout: halves rotated) of x (E, n, hd) at `positions` (E,), with the
    frequencies `inv_freq` (hd/2,) and cos/sin scaled by `scale` (rope_frequencies)."""
    hd = x.shape[-1]
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(x.device, torch.float32)[None, :]  # (E, hd/2)
    cos = (torch.cat([angles.cos(), angles.cos()], -1) * scale)[:, None, :].to(x.dtype)  # (E, 1, hd)
    sin = (torch.cat([angles.sin(), angles.sin()], -1) * scale)[:, None, :].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q (E, nh, hd), k/v (S, nkv, hd); mask: dense bool (E, S) -> SDPA, or a flex BlockMask (GPU)."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, rows, hd)
    if isinstance(mask, torch.Tensor):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        out = _flex_attention(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # (E, nh, hd)


_COMPILED_FLEX = None


def _flex_attention(compiled: bool):
    """flex_attention, compiled on GPU (a fused kernel); eager elsewhere (CPU tests, forward only)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX


class Attention(nn.Module):
    def __init__(self, arch: DrafterArch, in_dim: int):
        super().__init__()
        self.arch = arch
        nh, nkv, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_proj = nn.Linear(in_dim, nh * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, arch.hidden_size, bias=False)
        # a plain attribute, not a buffer: float32 whatever dtype the module is cast to (moved to the device
        # of the first input it rotates, once: not one host-to-device copy per call)
        self.inv_freq, self.rope_scale = rope_frequencies(arch)

    def forward(self, x, positions, mask, past_kv, query_start: int):
        """x (R, in) rows -> output for rows[query_start:], and (k, v) of all R rows (for later reuse)."""
        a = self.arch
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        k = rotate(self.k_proj(x).view(-1, a.num_kv_heads, a.head_dim), positions, self.inv_freq, self.rope_scale)
        v = self.v_proj(x).view(-1, a.num_kv_heads, a.head_dim)
        xq = x[query_start:]
        q = self.q_proj(xq).view(-1, a.num_heads, a.head_dim)
        q = rotate(q, positions[query_start:], self.inv_freq, self.rope_scale)
        keys, values = (k, v) if past_kv is None else (torch.cat([past_kv[0], k]), torch.cat([past_kv[1], v]))
        out = attend(q, keys, values, mask)  # (E, nh, hd)
        return self.o_proj(out.reshape(out.shape[0], -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: DrafterArch, index: int):
        super().__init__()
        h = arch.hidden_size
        self.index = index
        self.norm_before_residual = arch.norm_before_residual
        self.input_layernorm = RMSNorm(h, arch.rms_norm_eps)
        if index == 0:
            self.hidden_norm = RMSNorm(h, arch.rms_norm_eps)
        self.self_attn = Attention(arch, in_dim=2 * h if index == 0 else h)
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x, residual, embeds, positions, mask, past_kv, query_start: int):
        """Layer 0: x is the drafter hidden (R, H) and embeds the token embeddings; later: x, residual.
        Returns (mlp output, residual) for rows[query_start:] and this layer's (k, v) for all rows."""
        if self.index == 0:
            if self.norm_before_residual:
                x = self.hidden_norm(x)
                residual = x
            else:
                residual, x = x, self.hidden_norm(x)
            x = torch.cat([self.input_layernorm(embeds), x], dim=-1)  # (R, 2H)
        else:
            residual = x + residual
            x = self.input_layernorm(residual)
        attn, kv = self.self_attn(x, positions, mask, past_kv, query_start)
        residual = attn + residual[query_start:]
        return self.mlp(self.post_attention_layernorm(residual)), residual, kv


class Drafter(nn.Module):
    """P-EAGLE / EAGLE-3 drafter. `forward_elements` for training, `propose` for drafting at inference."""

    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.arch = arch
        h, a = arch.hidden_size, arch.num_aux * arch.hidden_size
        self.embed_tokens = nn.Embedding(arch.vocab_size, h)
        # P-EAGLE trains the embedding table so the mask token's row learns; EAGLE-3 keeps the target's.
        self.embed_tokens.weight.requires_grad_(arch.algorithm == "peagle")
        self.fc = nn.Linear(a, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(h, arch.rms_norm_eps)
        self.lm_head = nn.Linear(h, arch.draft_vocab_size, bias=False)
        if arch.algorithm == "peagle":
            self.mask_hidden = nn.Parameter(torch.zeros(1, 1, a))  # the shared hidden of every mask slot
        self.register_buffer("d2t", torch.zeros(arch.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(arch.vocab_size, dtype=torch.bool))
        # per-channel scale of fc's input (drafter.normalize_features); folded into fc.weight at export
        self.register_buffer("feature_scale", torch.ones(a))

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc of aux hidden states (or the mask hidden state), each channel scaled by feature_scale first."""
        return self.fc(aux * self.feature_scale)

    @torch.no_grad()
    def set_feature_scale(self, scale: torch.Tensor) -> None:
        """Scale fc's input channels by `scale` from now on, fc.weight rescaled so the drafter computes the
        same function: only the training dynamics change (Adam's steps act on unit-RMS inputs)."""
        scale = scale.to(self.feature_scale)
        self.fc.weight.mul_(self.feature_scale / scale)
        self.feature_scale.copy_(scale)

    # ---- one pass of the decoder stack -------------------------------------------------------------
    def _layers(self, hidden, embeds, positions, mask, past_kv, query_start: int):
        """hidden (R, H), embeds (R, H) -> pre-norm output (R - query_start, H) and per-layer (k, v).

        Only the last layer narrows its queries to rows[query_start:]; earlier layers must compute every
        row, because the last layer's keys depend on them.
        """
        x, residual, new_kv = hidden, None, []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            start = query_start if i == last else 0
            x, residual, kv = layer(
                x, residual, embeds, positions, mask(i == last), None if past_kv is None else past_kv[i], start
            )
            new_kv.append(kv)
        return x + residual, new_kv

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """(E, H) pre-norm hidden -> (E, DV) draft-vocabulary logits.

        Written as W @ x^T: for the few rows of a draft step, the CPU GEMM is 3-6x faster in this
        orientation than x @ W^T, and a single row is padded to two because the one-column product takes a
        ~3x slower matrix-vector kernel (measured for E = 1..8, H = 576, DV = 32768; `bench draft-latency`).
        Both algorithms share this, so EAGLE-3's one-row steps get the fast kernel too.
        """
        x = self.norm(prenorm)
        if x.shape[0] == 1:
            return (self.lm_head.weight @ x.repeat(2, 1).T).T[:1]
        return (self.lm_head.weight @ x.T).T

    def _mask_inputs(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and aux hidden of `count` P-EAGLE mask slots."""
        ids = torch.full((count,), self.arch.mask_token_id, dtype=torch.long, device=self.d2t.device)
        return ids, self.mask_hidden.view(1, -1).expand(count, -1)

    # ---- training ---------------------------------------------------------------------------------
    def forward_elements(self, tokens, aux_hidden, elements: Elements, mask_fn, num_context: int = 0,
                         depth_bounds: list[int] | None = None):  # fmt: skip
        """Pre-norm outputs (E - num_context, H) of depth-major `elements`; the first `num_context` are
        context (no output needed: the P-EAGLE last layer skips their queries).

        tokens (N,) and aux_hidden (N, A) are the sequence's per-position inputs. `mask_fn(rows, cols)`
        returns the attention mask between element index ranges (dense bool or flex BlockMask).
        `depth_bounds` (EAGLE-3 only): where each depth starts in `elements`, and their end (depth_bounds);
        the training step passes them from the host, else they are read from the device.
        """
        if self.arch.algorithm == "peagle":
            return self._forward_parallel(tokens, aux_hidden, elements, mask_fn, num_context)
        bounds = depth_bounds if depth_bounds is not None else depth_bounds_of(elements.depth)
        return self._forward_ttt(tokens, aux_hidden, elements, mask_fn, bounds)[num_context:]

    def _forward_parallel(self, tokens, aux_hidden, elements, mask_fn, num_context):
        e = len(elements)
        is_mask = elements.depth > 0
        ids = torch.where(is_mask, self.arch.mask_token_id, tokens[elements.anchor])
        aux = torch.where(is_mask[:, None], self.mask_hidden.view(1, -1), aux_hidden[elements.anchor])
        masks = {}  # built on first use: a 1-layer drafter only needs the narrow one

        def mask(last: bool):
            if last not in masks:
                masks[last] = mask_fn(slice(num_context if last else 0, e), slice(0, e))
            return masks[last]

        out, _ = self._layers(self.project(aux), self.embed_tokens(ids), elements.position, mask, None, num_context)
        return out

    def _forward_ttt(self, tokens, aux_hidden, elements, mask_fn, bounds):
        """EAGLE-3 training-time test: depth d (elements bounds[d]:bounds[d + 1]) runs after depth d-1, reusing
        its keys and values; the hidden input of (a, d) is the pre-norm output of (a, d-1)."""
        outputs, past_kv, slot_of_anchor = [], None, None
        for d in range(len(bounds) - 1):
            rows = slice(bounds[d], bounds[d + 1])
            step = elements.select(rows)
            ids = tokens[step.position]  # ground-truth next tokens (teacher forcing)
            if d == 0:
                hidden = self.project(aux_hidden[step.anchor])
            else:
                hidden = outputs[-1][slot_of_anchor[step.anchor]]
            mask = mask_fn(rows, slice(0, rows.stop))
            out, kv = self._layers(hidden, self.embed_tokens(ids), step.position, _every_layer(mask), past_kv, 0)
            past_kv = (
                kv
                if past_kv is None
                else [(torch.cat([p[0], k]), torch.cat([p[1], v])) for p, (k, v) in zip(past_kv, kv, strict=True)]
            )
            # anchors are positions (< N): a slot per position, no read of the largest anchor
            slot_of_anchor = torch.full((tokens.shape[0],), -1, dtype=torch.long, device=step.anchor.device)
            slot_of_anchor[step.anchor] = torch.arange(len(step), device=step.anchor.device)
            outputs.append(out)
        return torch.cat(outputs)

    # ---- drafting at inference ------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, cache: DraftCache, tokens, aux_hidden, num_tokens: int) -> torch.Tensor:
        """Draft `num_tokens` target-vocabulary ids after the newest position.

        tokens (m,), aux_hidden (m, A): the positions not yet in `cache`, shifted as in training (the last
        token is the one the target just sampled; the last hidden is the target's at the position before
        it). P-EAGLE drafts all tokens in one forward; EAGLE-3 runs one forward per token. The cache keeps
        only depth-0 keys/values, so rejected drafts never need rolling back.
        """
        m, start = tokens.shape[0], cache.length
        new = Elements(torch.arange(start, start + m), torch.zeros(m, dtype=torch.long))
        anchor = start + m - 1
        if self.arch.algorithm == "peagle":
            mask_ids, mask_aux = self._mask_inputs(num_tokens - 1)
            chain = Elements(torch.full((num_tokens - 1,), anchor), torch.arange(1, num_tokens))
            query = Elements.cat([new, chain])
            ids, aux = torch.cat([tokens, mask_ids]), torch.cat([aux_hidden, mask_aux])
            mask = cache.mask(query)
            out, kv = self._layers(
                self.project(aux), self.embed_tokens(ids), query.position, _every_layer(mask), cache.kv, 0
            )
            cache.append([(k[:m], v[:m]) for k, v in kv], m)
            draft = self.logits(out[m - 1 :]).argmax(-1)
            return draft + self.d2t[draft]

        out, kv = self._layers(
            self.project(aux_hidden), self.embed_tokens(tokens), new.position, lambda last: cache.mask(new), cache.kv, 0
        )
        cache.append(kv, m)
        drafted, hidden, chain_kv = [], out[-1:], list(cache.kv or [])
        for d in range(num_tokens):
            draft = self.logits(hidden).argmax(-1)
            drafted.append(draft + self.d2t[draft])
            if d == num_tokens - 1:
                break
            step = Elements(torch.tensor([anchor]), torch.tensor([d + 1]))
            keys = Elements.cat([cache.elements(), Elements(torch.full((d + 1,), anchor), torch.arange(1, d + 2))])
            mask = attention_mask_rows(step, keys)
            hidden, kv = self._layers(
                hidden, self.embed_tokens(drafted[-1]), step.position, _every_layer(mask), chain_kv, 0
            )
            chain_kv = [(torch.cat([p[0], k]), torch.cat([p[1], v])) for p, (k, v) in zip(chain_kv, kv, strict=True)]
        return torch.cat(drafted)


def attention_mask_rows(query: Elements, key: Elements) -> torch.Tensor:
    """The attention rule within one document (inference is always one document)."""
    one_doc = torch.zeros(int(torch.cat([query.anchor, key.anchor]).max()) + 1, dtype=torch.long)
    return attention_mask(query, key, one_doc)


class DraftCache:
    """Per-layer keys/values of the depth-0 elements at positions 0..length-1 (one request)."""

    def __init__(self, num_layers: int):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.length = 0
        self.num_layers = num_layers

    def elements(self) -> Elements:
        return Elements(torch.arange(self.length), torch.zeros(self.length, dtype=torch.long))

    def mask(self, query: Elements) -> torch.Tensor:
        """Mask of `query` over the cached elements followed by the query elements themselves."""
        return attention_mask_rows(query, Elements.cat([self.elements(), query]))

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], count: int) -> None:
        if self.kv is None:
            self.kv = kv
        else:
            self.kv = [(torch.cat([p[0], k]), torch.cat([p[1], v])) for p, (k, v) in zip(self.kv, kv, strict=True)]
        self.length += count


def depth_bounds_of(depth: torch.Tensor) -> list[int]:
    """Where each depth starts in depth-major elements, then their end: depths [0, 0, 0, 1, 1, 2] -> [0, 3, 5, 6]."""
    return torch.searchsorted(depth, torch.arange(int(depth.max()) + 2, device=depth.device)).tolist()


def _every_layer(mask):
    """The `mask(last_layer)` argument of Drafter._layers when every layer uses the same mask."""
    return lambda last: mask
