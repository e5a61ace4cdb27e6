"""bench peers' reference side: speculators' P-EAGLE computes our drafter's function, and trains.

speculators is installed by scripts/setup.sh (--no-deps: its own pins would replace the CPU torch wheel)."""

import pytest
import torch

from peagle_ray.bench import peers
from peagle_ray.config import DrafterConfig, build_config
from peagle_ray.drafter.build import drafter_for_target
from peagle_ray.train.elements import TrainSequence
from peagle_ray.train.step import mask_function, sample_elements

pytestmark = pytest.mark.slow  # builds the tiny target and imports speculators (a few seconds)
K, LAYERS = 3, [1, 3, 4]


@pytest.fixture(scope="module")
def models(tiny_target):
    drafter_cfg = DrafterConfig(num_depths=K, draft_vocab_size=300)
    ours, teacher, _ = drafter_for_target(tiny_target, drafter_cfg, None, len(LAYERS), torch.Generator().manual_seed(0))
    return drafter_cfg, ours, teacher, peers.build_reference(tiny_target, ours, LAYERS)


def sequence(ours, n=24, seed=1) -> TrainSequence:
    g = torch.Generator().manual_seed(seed)
    h = ours.arch.hidden_size
    supervised = torch.ones(n, dtype=torch.bool)
    supervised[:5] = False  # a prompt
    return TrainSequence(
        tokens=torch.randint(0, 300, (n,), generator=g),
        hidden=torch.randn(n, len(LAYERS) * h, generator=g),
        teacher_hidden=torch.randn(n, h, generator=g),
        supervised=supervised,
        doc_ids=torch.zeros(n, dtype=torch.long),
    )


def test_the_reference_with_our_weights_computes_our_logits_on_the_same_elements(models, monkeypatch):
    import speculators.models.peagle.core as core

    drafter_cfg, ours, _, reference = models
    assert reference.lm_head.weight.shape == ours.lm_head.weight.shape and torch.equal(reference.d2t, ours.d2t)
    reference.load_state_dict({k: v for k, v in ours.state_dict().items() if k != "feature_scale"}, strict=False)
    seq = sequence(ours)
    elements = sample_elements(seq, drafter_cfg, torch.Generator().manual_seed(2))
    assert int(elements.depth.max()) == K - 1  # every depth present: the mask-token path is compared too
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **_: (elements.anchor, elements.depth))
    captured = {}
    hook = reference.lm_head.register_forward_hook(lambda _m, _i, out: captured.setdefault("logits", out))
    cfg = build_config({"drafter": {"num_depths": K, "draft_vocab_size": 300}})
    loss, metrics = peers.reference_loss(reference, seq, cfg)
    hook.remove()
    with torch.no_grad():
        mine = ours.logits(
            ours.forward_elements(seq.tokens, seq.hidden, elements, mask_function(elements, seq.doc_ids, False))
        )
    torch.testing.assert_close(captured["logits"][0], mine, rtol=1e-5, atol=1e-5)
    assert loss.item() > 0 and int(metrics["position_2_acc_total"]) > 0


def test_reference_training_moves_its_weights_and_maps_back_onto_our_drafter(models):
    drafter_cfg, ours, _, reference = models
    cfg = build_config(
        {
            "drafter": {"num_depths": K, "draft_vocab_size": 300},
            "training": {"max_steps": 3, "sequences_per_step": 2, "warmup_steps": 1, "learning_rate": 1e-2},
        }
    )
    records = []
    for seed in range(3):
        seq = sequence(ours, seed=seed)
        # a captured record of T = N + 1 tokens (from_record shifts it back to N positions)
        records.append(
            {
                "input_ids": torch.cat([torch.tensor([0]), seq.tokens]),
                "loss_mask": torch.cat([torch.tensor([0, 0]), seq.supervised[:-1].long()]),
                "aux_hidden": torch.cat([seq.hidden, seq.hidden[-1:]]),
                "last_hidden": torch.cat([seq.teacher_hidden[:1], seq.teacher_hidden]),
            }
        )
    before = reference.fc.weight.detach().clone()
    row = peers.reference_train(reference, records, cfg, progress=lambda _line: None)
    assert row["steps"] == 3 and row["train_tokens"] == 3 * 2 * 24 and row["train_loss"] > 0
    assert not torch.equal(reference.fc.weight, before)
    drafter = peers.to_drafter(reference, ours)
    assert torch.equal(drafter.fc.weight, reference.fc.weight) and torch.equal(
        drafter.mask_hidden, reference.mask_hidden
    )
    assert not torch.equal(drafter.fc.weight, ours.fc.weight)  # a copy: our drafter is untouched


def test_best_ngram_picks_the_fastest_row_that_ran():
    rows = {
        "target": {"tokens_per_s": 10.0},
        "ngram-k2": {"tokens_per_s": 12.0},
        "ngram-k3": {"tokens_per_s": 13.5},
        "ngram-k4": {"failed": "engine exited"},
    }
    assert peers.best_ngram(rows) == "ngram-k3" and peers.best_ngram({"target": {}}) is None


def test_the_hybrid_is_judged_against_the_better_of_its_two_sources():
    rows = {
        "peagle": {"acceptance_length": 1.2, "speedup": 0.9, "speedup_se": 0.02},
        "suffix": {"acceptance_length": 2.0, "speedup": 1.6, "speedup_se": 0.1},
        "hybrid": {"acceptance_length": 2.1, "speedup": 1.5, "speedup_se": 0.1},
    }
    assert peers.hybrid_goals("humaneval", rows) == {
        "humaneval_hybrid_al_vs_best": (1.05, True),
        "humaneval_hybrid_speed_within_spread": (0.938, True),  # 1.5 + 0.2 >= 1.6
        "humaneval_hybrid_speed_vs_faster": (0.938, False),
    }
    slower = {**rows, "hybrid": {"acceptance_length": 1.9, "speedup": 1.2, "speedup_se": 0.1}}
    assert [met for _, met in peers.hybrid_goals("h", slower).values()] == [False, False, False]
    assert peers.hybrid_goals("h", {"suffix": rows["suffix"], "hybrid": rows["hybrid"]}) == {}  # one source ran
