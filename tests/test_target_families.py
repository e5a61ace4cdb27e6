"""The targets users bring: their rope (llama3, yarn) reproduced by the drafter and by vLLM from the export,
targets a drafter cannot be trained for refused before any work, and aux layers that stay distinct layers
of the target. The whole chain on each family is in test_demo.py."""

import json

import pytest
import torch

from peagle_ray.config import ConfigError, DrafterConfig, PeagleConfig, with_values
from peagle_ray.drafter.build import arch_from_target, drafter_for_target
from peagle_ray.drafter.model import Drafter, rope_frequencies, rotate
from peagle_ray.export.speculators import export_drafter
from peagle_ray.serve.app import free_port
from peagle_ray.target import TargetInfo, drafter_rope, drafter_target, rope_parameters
from tests.drafter_helpers import tiny_arch
from tests.helpers.tiny_target import FAMILIES, GPT_OSS_ROPE, LLAMA3_ROPE, build_tiny_target, family_spec

# config.json as Meta ships Llama-3.1-8B-Instruct (the rope keys) and OpenAI ships gpt-oss-20b
LLAMA31 = {
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
}
GPT_OSS = {
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
}


def test_rope_parameters_reads_both_spellings_of_config_json():
    assert rope_parameters(LLAMA31) == LLAMA3_ROPE
    assert rope_parameters(GPT_OSS) == GPT_OSS_ROPE
    assert rope_parameters({"rope_theta": 1000000.0, "rope_scaling": None}) == {
        "rope_type": "default",
        "rope_theta": 1000000.0,
    }
    assert rope_parameters({}) == {"rope_type": "default", "rope_theta": 10000.0}
    assert rope_parameters({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5.0}) == {
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": 5.0,
    }


@pytest.mark.parametrize(
    "config, message",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type = 'dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope_type = 'longrope' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5 is not supported"),
        ({"rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}, "mrope_section"),
    ],
)
def test_a_rope_the_drafter_cannot_reproduce_is_refused_naming_the_field(config, message):
    with pytest.raises(ConfigError, match=message):
        drafter_rope(config, "t/config.json")


@pytest.mark.parametrize("layers, expected", [(30, [2, 15, 29]), (6, [2, 3, 5]), (5, [2, 3, 4]), (4, [1, 2, 3]),
                                              (3, [0, 1, 2]), (2, [0, 1]), (1, [0])])  # fmt: skip
def test_default_aux_layers_are_distinct_layers_of_the_target(layers, expected):
    assert TargetInfo(None, layers, 8, 8, "llama").default_aux_layer_ids() == expected  # type: ignore[arg-type]


def test_aux_layers_outside_the_target_or_repeated_are_refused():
    info = TargetInfo(None, 4, 8, 8, "qwen3")  # type: ignore[arg-type]
    assert info.aux_layer_ids([0, 3]) == [0, 3]
    with pytest.raises(ConfigError, match=r"capture.aux_layer_ids must be layers 0..3 .*got \[1, 4\], \[4\] outside"):
        info.aux_layer_ids([1, 4])
    with pytest.raises(ConfigError, match=r"capture.aux_layer_ids must be distinct layers; got \[2, 2, 3\], \[2\]"):
        info.aux_layer_ids([2, 2, 3])


def arch_with(rope: dict):
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return tiny_arch(rope_theta=rope["rope_theta"], rope_scaling=scaling if rope["rope_type"] != "default" else None)


def test_llama3_rope_scales_only_the_low_frequencies():
    plain, _ = rope_frequencies(arch_with({"rope_type": "default", "rope_theta": 500000.0}))
    scaled, scale = rope_frequencies(arch_with(LLAMA3_ROPE))
    wavelength = 2 * torch.pi / plain
    short, long = wavelength < 8192 / 4.0, wavelength > 8192 / 1.0  # high_freq / low_freq bounds
    assert scale == 1.0 and short.any() and long.any()
    torch.testing.assert_close(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8.0)


@pytest.mark.slow  # imports vLLM (~7 s); no engine
@pytest.mark.parametrize("rope", [LLAMA3_ROPE, GPT_OSS_ROPE, {"rope_type": "default", "rope_theta": 1e6}])
def test_the_drafters_rotary_embedding_equals_vllms_past_the_original_context(rope, tmp_path):
    """The export's config.json read by vLLM's own config loader, and the rotary embedding its Llama layer
    builds from it (get_rope), against ours."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config

    arch = arch_with(rope)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    out = export_drafter(Drafter(arch), tmp_path / "drafter", target, [0, 1, 2], 2, max_position_embeddings=200000)
    config = get_config(str(out), trust_remote_code=False)
    with set_current_vllm_config(VllmConfig()):
        theirs = get_rope(config.head_dim, config.max_position_embeddings, True, config.rope_parameters, torch.float32)
    positions = torch.tensor([0, 1, 17, 4095, 4096, 8191, 8192, 9000, 40000, 131071])  # past 4096 and 8192
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), arch.num_heads, arch.head_dim, generator=g)
    k = torch.randn(len(positions), arch.num_kv_heads, arch.head_dim, generator=g)
    want_q, want_k = theirs.forward_native(positions, q.flatten(1).clone(), k.flatten(1).clone())
    inv_freq, scale = rope_frequencies(arch)
    torch.testing.assert_close(rotate(q, positions, inv_freq, scale), want_q.view_as(q), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate(k, positions, inv_freq, scale), want_k.view_as(k), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def family_targets(tmp_path_factory):
    return {name: build_tiny_target(tmp_path_factory.mktemp(name), FAMILIES[name]) for name in FAMILIES}


@pytest.mark.slow  # writes ~300 MB of targets with real vocabulary sizes
def test_each_family_builds_a_drafter_and_exports_its_rope_for_vllm(family_targets, tmp_path):
    expected_rope = {"llama": None, "llama3": LLAMA3_ROPE, "qwen3": None, "gpt-oss-rope": GPT_OSS_ROPE}
    for name, target in family_targets.items():
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        counts = torch.zeros(vocab)
        counts[torch.arange(0, vocab, 97)] = torch.arange(0, vocab, 97).float()  # most frequent: the last ids
        drafter, teacher, mask = drafter_for_target(
            target, DrafterConfig(num_depths=2, draft_vocab_size=64), counts, 3, torch.Generator().manual_seed(0)
        )
        arch = drafter.arch
        rope = expected_rope[name]
        assert arch.rope_parameters == (rope or {"rope_type": "default", "rope_theta": arch.rope_theta}), name
        # the draft vocabulary over the full vocabulary: the 64 most counted ids, far past the tokenizer's
        draft_to_target = torch.arange(64) + drafter.d2t
        assert set(sorted(range(97, vocab, 97))[-64:]) <= set(draft_to_target.tolist()), name
        assert drafter.t2d.shape == (vocab,) and int(drafter.t2d.sum()) == 64
        out = export_drafter(drafter, tmp_path / name, target, [1, 2, 3], 2)
        layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
        assert layer["rope_parameters"] == arch.rope_parameters and layer["vocab_size"] == vocab, name
        assert mask is not None and mask.id < vocab


@pytest.mark.slow
def test_a_target_no_drafter_can_be_trained_for_is_refused_before_any_work(tmp_path):
    target = build_tiny_target(tmp_path / "t", family_spec("llama", num_layers=2))
    cfg = with_values(PeagleConfig(), {"target.path": str(target)})
    assert drafter_target(cfg).default_aux_layer_ids() == [0, 1]
    with pytest.raises(ConfigError, match=r"capture.aux_layer_ids must be layers 0..1 .*\[5\] outside"):
        drafter_target(with_values(cfg, {"capture.aux_layer_ids": [0, 5]}))
    config = json.loads((target / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"target {target}/config.json: rope_parameters.rope_type = 'dynamic'"):
        drafter_target(cfg)
    with pytest.raises(ConfigError, match="rope_type = 'dynamic'"):
        arch_from_target(target, DrafterConfig(), None, 0, 3)


@pytest.mark.vllm
def test_a_qwen3_target_captures_what_transformers_computes(family_target, tmp_path, ray_local):
    """Qwen3 (q/k norms, tied embeddings, 151,936 rows, 4 layers: default aux layers [1, 2, 3]) through the
    Serve-hosted engine: the hidden states equal transformers'. (Repeated aux layers killed this engine.) In
    a file of its own kind: a second target session beside test_capture.py's would replace its Serve app."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from peagle_ray.capture.reference import hf_hidden_states
    from peagle_ray.capture.run import target_session
    from peagle_ray.capture.stage import validate_capture
    from peagle_ray.config import build_config

    target = family_target("qwen3")
    cfg = build_config(
        {
            "target": {"path": str(target), "max_model_len": 128, "kv_cache_gib": 1},
            "capture": {"output_dir": str(tmp_path / "hidden")},
            "serving": {"port": free_port()},  # Serve's HTTP proxy: not 8000, which another worker may hold
        }
    )
    ids = list(range(20, 60))
    with target_session(cfg) as s:
        (captured,) = s.handle.capture_batch.remote([ids]).result()["items"]
        layers, hidden = s.info.default_aux_layer_ids(), s.info.hidden_size
        aux, last = validate_capture(np.array(ids), captured, s.num_layers_captured, hidden, "float32")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf_aux, hf_last = hf_hidden_states(model, torch.tensor(ids), layers)
    assert layers == [1, 2, 3]
    torch.testing.assert_close(torch.from_numpy(aux), hf_aux, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.from_numpy(last), hf_last, atol=1e-4, rtol=1e-4)
