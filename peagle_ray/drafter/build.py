"""Build a drafter (and the frozen teacher head) from a target directory.

Shapes (H, heads, head_dim, intermediate size, rope type and parameters, norm eps) come from the target's
config.json; the drafter's embed_tokens and lm_head rows, and the teacher's norm and head, come from the target's
safetensors (tied embeddings: lm_head is embed_tokens). Everything else is initialised from an explicit
seeded generator.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from peagle_ray.config import ConfigError, DrafterConfig
from peagle_ray.drafter.model import Drafter, DrafterArch
from peagle_ray.drafter.teacher import Teacher
from peagle_ray.drafter.vocab import MaskToken, draft_vocabulary, resolve_mask_token
from peagle_ray.target import drafter_rope, text_config


def arch_from_target(
    target_dir: Path, drafter: DrafterConfig, draft_vocab_size: int | None, mask_token_id: int | None, num_aux: int
) -> DrafterArch:
    cfg = text_config(target_dir)
    rope = drafter_rope(cfg, f"target {target_dir}/config.json")
    return arch_from_config(cfg, rope, drafter, draft_vocab_size, mask_token_id, num_aux)


def arch_from_config(
    cfg: dict,
    rope: dict,
    drafter: DrafterConfig,
    draft_vocab_size: int | None,
    mask_token_id: int | None,
    num_aux: int,
) -> DrafterArch:
    """The drafter's arch from the target's config.json fields `cfg` and its checked rope (drafter_rope)."""
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    rope = dict(rope)
    theta = float(rope.pop("rope_theta"))
    return DrafterArch(
        algorithm=drafter.algorithm,
        num_depths=drafter.trained_depths,
        num_layers=drafter.num_layers,
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        vocab_size=cfg["vocab_size"],
        draft_vocab_size=draft_vocab_size or cfg["vocab_size"],
        num_aux=num_aux,
        rope_theta=theta,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        mask_token_id=mask_token_id if drafter.algorithm == "peagle" else None,
        norm_before_residual=drafter.norm_before_residual,
        rope_scaling=rope if rope["rope_type"] != "default" else None,
    )


def load_target_tensors(target_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read just `names` from the target's safetensors shards (first match wins)."""
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in set(names) & set(f.keys()) - set(found):
                found[name] = f.get_tensor(name)
    return found


def target_head(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embed_tokens (V, H), lm_head (V, H), final norm weight (H,)) of a Llama/Qwen-style target."""
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    t = load_target_tensors(target_dir, names)
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in t]
    if missing:
        raise ValueError(f"target {target_dir} has no {missing} in its safetensors")
    lm_head = t.get("lm_head.weight", t["model.embed_tokens.weight"])  # tied embeddings
    return t["model.embed_tokens.weight"], lm_head, t["model.norm.weight"]


def build_drafter(
    target_dir: Path,
    arch: DrafterArch,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    generator: torch.Generator,
    init_std: float,
) -> tuple[Drafter, Teacher]:
    """A freshly initialised drafter and the teacher head for `arch` over the draft vocabulary `d2t`."""
    embed, lm_head, norm = target_head(target_dir)
    draft_rows = torch.arange(arch.draft_vocab_size) + d2t  # target id of each draft id
    drafter = Drafter(arch)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if param.ndim >= 2 or name == "mask_hidden":
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)
        drafter.embed_tokens.weight.copy_(embed.float())
        drafter.lm_head.weight.copy_(lm_head[draft_rows].float())
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    teacher = Teacher(norm.float(), lm_head[draft_rows].float(), arch.rms_norm_eps)
    return drafter, teacher


LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
"""A Llama/Qwen-style decoder layer's tensors the drafter's layers share (names after `model.layers.j.`)."""


def target_layers_for(num_target_layers: int, first: int, num_layers: int) -> list[int]:
    """The target layers drafter layers 0..num_layers-1 start from (drafter.init_from_target = `first`,
    negative counting from the top). e.g. 30 target layers, first -1, 1 layer -> [29]; first -2, 2 -> [28, 29]."""
    start = first + num_target_layers if first < 0 else first
    layers = list(range(start, start + num_layers))
    if start < 0 or layers[-1] >= num_target_layers:
        raise ConfigError(
            f"drafter.init_from_target = {first}: drafter layers 0..{num_layers - 1} would start from target layers "
            f"{layers}, but the target has layers 0..{num_target_layers - 1}"
        )
    return layers


@torch.no_grad()
def init_from_target(
    drafter: Drafter, target_dir: Path, first: int, embed_half: Literal["random", "zero"] = "random"
) -> tuple[list[int], list[str]]:
    """Start `drafter` from what the target knows (drafter.init_from_target): decoder layer i from target layer
    first + i (attention, MLP, norms), fc passing the top aux feature through unchanged (identity on the last
    aux block, zero elsewhere), the final norm from the target's; the head rows are the target's already.

    Layer 0 reads [embeds; hidden] (2H): the target layer's q/k/v go to the hidden half and its input norm to
    hidden_norm, so with the top aux layer as the copied layer's own input the untrained drafter's depth-0
    output is the target layer's output at the anchor; the embedding half stays random (init_std) or zero.
    A tensor the target lacks (GPT-OSS's mixture-of-experts MLP) stays random; what the drafter's layer has no
    place for (Qwen3's q/k norms, GPT-OSS's attention biases and sinks) is left out, so there the copy
    approximates the target's layer. Returns (target layers, missing names).
    """
    arch = drafter.arch
    layers = target_layers_for(text_config(target_dir)["num_hidden_layers"], first, arch.num_layers)
    names = [f"model.layers.{j}.{t}" for j in layers for t in LAYER_TENSORS] + ["model.norm.weight"]
    found = load_target_tensors(target_dir, names)
    h = arch.hidden_size
    for i, j in enumerate(layers):
        own = drafter.layers[i]
        for t in LAYER_TENSORS:
            name = f"model.layers.{j}.{t}"
            if name not in found:
                continue
            source = found[name].float()
            if i == 0 and t.startswith("self_attn.") and t[10] in "qkv":  # layer 0's 2H input: the hidden half
                weight = own.get_parameter(t)
                weight[:, h:] = source
                if embed_half == "zero":
                    weight[:, :h] = 0.0
            elif i == 0 and t == "input_layernorm.weight":
                own.hidden_norm.weight.copy_(source)
                own.input_layernorm.weight.copy_(source)
            else:
                own.get_parameter(t).copy_(source)
    if "model.norm.weight" in found:
        drafter.norm.weight.copy_(found["model.norm.weight"].float())
    fc = drafter.fc.weight  # (H, num_aux * H): the last block is the top aux layer
    fc.zero_()
    fc[:, -h:] = torch.eye(h) / drafter.feature_scale[-h:]
    return layers, [name for name in names if name not in found]


def mask_token(target_dir: Path, drafter_cfg: DrafterConfig, tokenizer=None) -> MaskToken | None:
    """P-EAGLE's mask token for this target (vocab.resolve_mask_token: drafter.mask_token_id, else from
    `tokenizer`, default the target's); None for EAGLE-3. Loading the tokenizer imports transformers (~5-10 s
    of CPU): the training driver chooses once and hands every worker its id and origin (WorkerPlan.mask_token)."""
    if drafter_cfg.algorithm != "peagle":
        return None
    if tokenizer is None and drafter_cfg.mask_token_id is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return resolve_mask_token(tokenizer, text_config(target_dir)["vocab_size"], drafter_cfg.mask_token_id)


def drafter_for_target(
    target_dir: Path,
    drafter_cfg: DrafterConfig,
    token_counts: torch.Tensor | None,
    num_aux: int,
    generator: torch.Generator,
    tokenizer=None,
    init_from: str | None = None,
    feature_scale: torch.Tensor | None = None,
    mask: MaskToken | None = None,
) -> tuple[Drafter, Teacher, MaskToken | None]:
    """Everything from config: mask token (P-EAGLE), draft vocabulary from token counts, arch, weights
    (the target's layers where drafter.init_from_target says so; then another drafter's, when `init_from` names one: training.init_from), then `feature_scale` on fc's
    input (drafter.normalize_features; the function is kept, see Drafter.set_feature_scale).

    `mask`: the mask token mask_token chose (a training worker gets the driver's); None: chosen here, with
    `tokenizer` (default: the target's; when the mask token has to be added it is added to this object).
    """
    info_vocab = text_config(target_dir)["vocab_size"]
    mask = mask or mask_token(target_dir, drafter_cfg, tokenizer)
    counts = token_counts if token_counts is not None else torch.ones(info_vocab)
    inherited = initial_vocabulary(init_from, info_vocab) if init_from is not None else None
    d2t, t2d = inherited or draft_vocabulary(counts, drafter_cfg.draft_vocab_size)
    arch = arch_from_target(target_dir, drafter_cfg, d2t.shape[0], mask.id if mask else None, num_aux)
    drafter, teacher = build_drafter(target_dir, arch, d2t, t2d, generator, drafter_cfg.init_std)
    if drafter_cfg.init_from_target is not None:
        layers, missing = init_from_target(
            drafter, target_dir, drafter_cfg.init_from_target, drafter_cfg.init_embed_half
        )
        if missing:
            logging.getLogger("peagle_ray.drafter").warning(
                "drafter.init_from_target = %s: target layers %s have no %s; those drafter tensors keep their "
                "random init",
                drafter_cfg.init_from_target,
                layers,
                missing,
            )
    if init_from is not None:
        load_initial_weights(drafter, init_from)
    if feature_scale is not None:
        drafter.set_feature_scale(feature_scale)
    drafter.lm_head.weight.requires_grad_(not drafter_cfg.freeze_lm_head)
    freeze(drafter, drafter_cfg.frozen)
    return drafter, teacher, mask


def channel_scale(aux_hidden: list[torch.Tensor], floor: float = 1e-3) -> torch.Tensor:
    """1 / RMS of each aux-hidden channel over every position of `aux_hidden` ((T, A) each), the RMS floored
    at `floor`: drafter.normalize_features' scale.

    e.g. one record [[3, 0], [-3, 0]] -> RMS [3, 0] -> [1/3, 1/floor]."""
    rows = torch.cat([torch.as_tensor(a).float() for a in aux_hidden])
    return 1.0 / rows.pow(2).mean(0).sqrt().clamp(min=floor)


def freeze(drafter: torch.nn.Module, prefixes: list[str]) -> None:
    """Stop the gradient of every parameter whose name starts with one of `prefixes` (drafter.frozen)."""
    names = [name for name, _ in drafter.named_parameters()]
    for prefix in prefixes:
        if not any(name.startswith(prefix) for name in names):
            raise ConfigError(f"drafter.frozen: {prefix!r} names no parameter of the drafter; its parameters: {names}")
    for name, param in drafter.named_parameters():
        if any(name.startswith(prefix) for prefix in prefixes):
            param.requires_grad_(False)


def _weights_file(source: Path) -> Path:
    files = [source / name for name in ("model.safetensors", "drafter.safetensors") if (source / name).is_file()]
    if not files:
        raise FileNotFoundError(
            f"training.init_from must be an exported drafter or a checkpoint directory (with "
            f"model.safetensors or drafter.safetensors); got {source}"
        )
    return files[0]


def initial_vocabulary(source: str | Path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(d2t, t2d) of the drafter a run starts from, None when it has no reduced vocabulary: fine-tuning
    keeps the draft vocabulary its head was trained on, whatever the new data's token counts say.
    e.g. d2t [0, 1, 5] (target ids 0, 2, 7) in a vocabulary of 8 -> t2d [1, 0, 1, 0, 0, 0, 0, 1]."""
    from safetensors import safe_open

    with safe_open(str(_weights_file(Path(source))), "pt") as f:
        if "d2t" not in f.keys():
            return None
        d2t = f.get_tensor("d2t").long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t + torch.arange(d2t.shape[0])] = True
    return d2t, t2d


def load_initial_weights(drafter: Drafter, source: str | Path) -> list[str]:
    """Copy the tensors of an exported drafter (model.safetensors) or a training checkpoint
    (drafter.safetensors) that match `drafter`'s names and sizes; returns the names copied. The draft
    vocabularies (d2t) must be equal: the head rows would mean other tokens otherwise."""
    from safetensors.torch import load_file

    source = Path(source)
    weights = load_file(str(_weights_file(source)))
    own = drafter.state_dict()
    if "d2t" in weights and not torch.equal(weights["d2t"], own["d2t"]):
        raise ValueError(
            f"training.init_from = {source}: its draft vocabulary differs from this run's "
            "(train both on the same data.output_dir and drafter.draft_vocab_size)"
        )
    copied = [name for name, t in weights.items() if name in own and t.numel() == own[name].numel()]
    with torch.no_grad():
        for name in copied:
            own[name].copy_(weights[name].reshape(own[name].shape))
    return copied
