"""Build a drafter (and the frozen teacher head) from a target directory.

Shapes (H, heads, head_dim, intermediate size, rope type and parameters, norm eps) come from the target's
config.json; the drafter's embed_tokens and lm_head rows, and the teacher's norm and head, come from the target's
safetensors (tied embeddings: lm_head is embed_tokens). Everything else is initialised from an explicit
seeded generator.
"""

from __future__ import annotations

from pathlib import Path

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


def drafter_for_target(
    target_dir: Path,
    drafter_cfg: DrafterConfig,
    token_counts: torch.Tensor | None,
    num_aux: int,
    generator: torch.Generator,
    tokenizer=None,
    init_from: str | None = None,
    feature_scale: torch.Tensor | None = None,
) -> tuple[Drafter, Teacher, MaskToken | None]:
    """Everything from config: mask token (P-EAGLE), draft vocabulary from token counts, arch, weights
    (then another drafter's, when `init_from` names one: training.init_from), then `feature_scale` on fc's
    input (drafter.normalize_features; the function is kept, see Drafter.set_feature_scale).

    `tokenizer` defaults to the target's; when the mask token has to be added it is added to this object.
    """
    from transformers import AutoTokenizer

    info_vocab = text_config(target_dir)["vocab_size"]
    mask = None
    if drafter_cfg.algorithm == "peagle":
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(target_dir)
        mask = resolve_mask_token(tokenizer, info_vocab, drafter_cfg.mask_token_id)
    counts = token_counts if token_counts is not None else torch.ones(info_vocab)
    inherited = initial_vocabulary(init_from, info_vocab) if init_from is not None else None
    d2t, t2d = inherited or draft_vocabulary(counts, drafter_cfg.draft_vocab_size)
    arch = arch_from_target(target_dir, drafter_cfg, d2t.shape[0], mask.id if mask else None, num_aux)
    drafter, teacher = build_drafter(target_dir, arch, d2t, t2d, generator, drafter_cfg.init_std)
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
