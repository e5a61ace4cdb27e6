"""`peagle-ray train --dry-run`: the plan from a config and a target's config.json alone, its memory model
checked against the live tensor bytes of real training steps on CPU, and the 8B GPU configs planned."""

import json
import subprocess
import sys

import pytest
import torch

from peagle_ray.bench.shapes import SMOLLM2_SHAPE, random_drafter, random_sequence
from peagle_ray.config import load_config
from peagle_ray.drafter.build import freeze
from peagle_ray.train.plan import SegmentShape, elements_per_position, plan_training
from peagle_ray.train.step import make_optimizer, train_step
from tests.conftest import REPO
from tests.helpers.live_memory import LiveTensorBytes
from tests.test_target_families import LLAMA31

# config.json fields of the released models (their rope as shipped)
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    **LLAMA31,  # its rope, as shipped
}
SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": SMOLLM2_SHAPE["hidden_size"],
    "intermediate_size": SMOLLM2_SHAPE["intermediate_size"],
    "num_hidden_layers": 30,
    "num_attention_heads": SMOLLM2_SHAPE["num_heads"],
    "num_key_value_heads": SMOLLM2_SHAPE["num_kv_heads"],
    "vocab_size": SMOLLM2_SHAPE["vocab_size"],
    "rope_theta": SMOLLM2_SHAPE["rope_theta"],
    "rms_norm_eps": SMOLLM2_SHAPE["rms_norm_eps"],
}


def config_dir(tmp_path, fields: dict):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return tmp_path


def test_cod_and_partitioning_shapes_worked_examples():
    assert elements_per_position(4, 0.7, 0.2) == pytest.approx(2.533)
    assert elements_per_position(8, 0.7, 0.2) == pytest.approx(3.3731)  # 1 + .7 + .49 + .343 + .2401 + 3 x .2
    assert SegmentShape.of(2048, 5188, 1024) == SegmentShape(5188, 6, 865, 1706)
    assert SegmentShape.of(1024, 2594, 4096) == SegmentShape(2594, 1, 2594, 0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"drafter.num_depths": 4, "drafter.draft_vocab_size": 32768, "data.max_length": 1024},
        {"drafter.num_depths": 8, "drafter.draft_vocab_size": 8192, "data.max_length": 2048},  # 4 segments
        {  # the whole sequence in one segment: activations ~70% of the peak
            "drafter.num_depths": 8,
            "drafter.draft_vocab_size": 8192,
            "data.max_length": 2048,
            "training.segment_length": 100000,
        },
        {  # two layers, the embedding trained, the head frozen
            "drafter.num_layers": 2,
            "drafter.draft_vocab_size": 8192,
            "drafter.frozen": [],
            "drafter.freeze_lm_head": True,
            "data.max_length": 1024,
        },
        {"drafter.draft_vocab_size": 1024, "data.max_length": 128, "training.precision": "bfloat16"},
    ],
)
@pytest.mark.slow  # a real training step on SmolLM2's shape, 3-13 s each
def test_the_dry_runs_peak_is_within_20_percent_of_a_measured_training_step(tmp_path, overrides):
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    plan = plan_training(cfg, config_dir(tmp_path, SMOLLM2))
    drafter, teacher = random_drafter(plan.arch)
    drafter.lm_head.weight.requires_grad_(not cfg.drafter.freeze_lm_head)
    freeze(drafter, cfg.drafter.frozen)
    optimizer, scheduler = make_optimizer(drafter, cfg.training)
    g = torch.Generator().manual_seed(0)
    seq = random_sequence(plan.arch, cfg.data.max_length, g)
    step = lambda: train_step(drafter, teacher, optimizer, scheduler, [seq], cfg.drafter, cfg.training, g)  # noqa: E731
    for param in drafter.parameters():  # AdamW's moments exist from the first step on: made here by a step on
        param.grad = torch.zeros_like(param) if param.requires_grad else None  # zero gradients, not a real one
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    existing = [*drafter.parameters(), *drafter.buffers(), *teacher.parameters(), *teacher.buffers(), *state]
    with LiveTensorBytes([*existing, seq.tokens, seq.hidden, seq.teacher_hidden]) as measured:
        step()
    estimate = plan.partitioned.peak
    print(f"PLAN {overrides} estimate {estimate / 2**20:.0f} MiB measured {measured.peak / 2**20:.0f} MiB")
    assert 0.8 < estimate / measured.peak < 1.2, (estimate / 2**20, measured.peak / 2**20)


@pytest.mark.parametrize("config, fields", [("qwen3-8b-gpu.yaml", QWEN3_8B), ("llama3.1-8b-gpu.yaml", LLAMA31_8B)])
def test_the_8b_gpu_configs_dry_run(tmp_path, config, fields):
    cfg = load_config(REPO / "configs" / config)
    plan = plan_training(cfg, config_dir(tmp_path, fields))
    a = plan.arch
    assert (a.hidden_size, a.num_layers, a.draft_vocab_size, a.num_depths) == (4096, 4, 32768, 8)
    assert a.vocab_size == fields["vocab_size"] and plan.refused == []
    assert a.rope_parameters["rope_type"] == ("llama3" if "llama" in config else "default")
    # embeddings frozen (drafter.frozen's default): V x H of them
    assert plan.frozen_parameters == fields["vocab_size"] * 4096
    assert plan.partitioned.peak < plan.whole.peak < 80 * 2**30
    text = plan.render(80)
    assert "| **peak** |" in text and "refused: nothing" in text and f"{fields['vocab_size']:,}" in text
    assert "training.segment_length = 16384 (segments of ~13,816 elements): the partitioned peak" in plan.render(24)


def test_a_refused_rope_and_aux_layers_are_listed_not_raised(tmp_path):
    fields = {**SMOLLM2, "num_hidden_layers": 4, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    plan = plan_training(load_config(None, ["capture.aux_layer_ids=[1,9,2]"]), config_dir(tmp_path, fields))
    assert len(plan.refused) == 2
    assert "rope_type = 'dynamic'" in plan.refused[0] and "[9] outside" in plan.refused[1]
    assert plan.arch.rope_parameters["rope_type"] == "default"  # the shapes are still planned


@pytest.mark.slow  # a subprocess
def test_train_dry_run_on_the_command_line(tmp_path):
    target = config_dir(tmp_path, LLAMA31_8B)
    cmd = [sys.executable, "-m", "peagle_ray.cli", "train", "--dry-run", "--config"]
    cmd += [str(REPO / "configs/llama3.1-8b-gpu.yaml"), "--target-config", str(target)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "parameters " in out.stdout and "'rope_type': 'llama3'" in out.stdout and "| **peak** |" in out.stdout
