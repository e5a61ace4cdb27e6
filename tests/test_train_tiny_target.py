"""The drafter built from a real (tiny) target directory, trained on hidden states the target produced."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from peagle_ray.capture.reference import hf_hidden_states
from peagle_ray.config import ConfigError, build_config
from peagle_ray.drafter.build import drafter_for_target, target_head, target_layers_for
from peagle_ray.drafter.elements import Elements
from peagle_ray.drafter.vocab import count_tokens
from peagle_ray.target import read_target_info
from peagle_ray.train.elements import TrainSequence, cod_sample
from peagle_ray.train.step import mask_function, sequence_backward, train_drafter
from tests.helpers.tiny_target import TinyTargetSpec, build_tiny_target

CONVERSATIONS = [
    ("How do I read a file?", "Use open(path) and call read() on it; the with statement closes it for you."),
    ("What is a socket?", "A socket is one endpoint of a two-way network connection between programs."),
    ("Sort a list.", "Call sorted(items) for a new list, or items.sort() to sort the list in place."),
]


@pytest.fixture(scope="module")
def records(tiny_target):
    """(input_ids, loss_mask, aux, last) per conversation; loss mask = the assistant reply's tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    aux_ids = read_target_info(tiny_target).default_aux_layer_ids()
    out = []
    for user, assistant in CONVERSATIONS:
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]

        def render(m, **kw):
            return tokenizer(tokenizer.apply_chat_template(m, tokenize=False, **kw), add_special_tokens=False)[
                "input_ids"
            ]

        prompt, full = render(messages[:1], add_generation_prompt=True), render(messages)
        ids = torch.tensor(full)
        loss_mask = torch.zeros(len(full), dtype=torch.bool)
        loss_mask[len(prompt) :] = True
        aux, last = hf_hidden_states(model, ids, aux_ids)
        out.append((ids, loss_mask, aux, last))
    return out


def make(tiny_target, records, **drafter):
    cfg = build_config(
        {
            "drafter": {"num_depths": 3, "draft_vocab_size": 64, **drafter},
            "training": {
                "learning_rate": 3e-3,
                "warmup_steps": 2,
                "max_steps": 12,
                "segment_length": 40,
                "sequences_per_step": 2,
            },
        }
    )
    counts = count_tokens([(ids, mask) for ids, mask, _, _ in records], read_target_info(tiny_target).vocab_size)
    drafter_model, teacher, mask = drafter_for_target(
        tiny_target, cfg.drafter, counts, 3, torch.Generator().manual_seed(0)
    )
    return cfg, drafter_model, teacher, mask


def test_teacher_logits_are_the_targets_logits_on_draft_rows(tiny_target, records):
    _, drafter, teacher, _ = make(tiny_target, records)
    ids, _, _, last = records[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    with torch.no_grad():
        target_logits = model(ids[None]).logits[0]
    draft_rows = torch.arange(64) + drafter.d2t
    torch.testing.assert_close(
        teacher.normed(last) @ teacher.head.T, target_logits[:, draft_rows], atol=1e-4, rtol=1e-4
    )


def test_drafter_takes_embeddings_and_head_rows_from_the_target(tiny_target, records):
    _, drafter, _, mask = make(tiny_target, records)
    embed, lm_head, _ = target_head(tiny_target)
    assert torch.equal(drafter.embed_tokens.weight, embed)
    assert torch.equal(drafter.lm_head.weight, lm_head[torch.arange(64) + drafter.d2t])
    assert not torch.equal(lm_head, embed)  # the tiny target is untied
    assert mask.source == "tokenizer mask token '<|MASK|>'"
    assert drafter.arch.draft_vocab_size == 64 and int(drafter.t2d.sum()) == 64


def test_a_drafter_started_from_the_target_computes_its_last_layer(tiny_target, records):
    """drafter.init_from_target = -1 with the embedding half zero: layer 0 is the target's last layer fed the
    top aux feature (that layer's own input), so the untrained drafter's depth-0 logits are the target's at
    every anchor. With the embedding half random they are not, but the direction holds: the untrained
    drafter's depth-0 accuracy beats a random drafter's on the same elements."""
    _, drafter, teacher, _ = make(tiny_target, records, init_from_target=-1, init_embed_half="zero")
    ids, _, aux, last = records[0]
    n = len(ids)
    elements = Elements(torch.arange(n), torch.zeros(n, dtype=torch.long))
    out = drafter.forward_elements(ids, aux, elements, mask_function(elements, torch.zeros(n, dtype=torch.long), False))
    torch.testing.assert_close(
        drafter.logits(out), teacher.normed(last) @ teacher.head.T, atol=1e-4, rtol=1e-4
    )  # fmt: skip
    sequences = [TrainSequence.from_record(*r) for r in records]
    accuracy = {}
    for name, init in (("random", None), ("target", -1)):
        cfg, model, teacher, _ = make(tiny_target, records, init_from_target=init)
        stats = [
            sequence_backward(
                model,
                teacher,
                seq,
                cod_sample(seq.supervised, seq.doc_ids, 3, 0.7, 0.2, torch.Generator().manual_seed(0)),
                10**6,
                None,
                backward=False,
            )  # fmt: skip
            for seq in sequences
        ]
        accuracy[name] = sum(s.depth_correct[0] for s in stats) / sum(s.depth_count[0] for s in stats)
    assert accuracy["target"] > accuracy["random"], accuracy


def test_init_from_target_keeps_what_the_target_lacks_random_and_says_so(tiny_target, records, tmp_path, caplog):
    """A target without a dense MLP (GPT-OSS's experts): the attention and norms are copied, the MLP keeps its
    random init, and building the drafter logs which tensors were missing."""
    import shutil

    from safetensors.torch import load_file, save_file

    moe = tmp_path / "no-dense-mlp"
    shutil.copytree(tiny_target, moe)
    weights = load_file(str(moe / "model.safetensors"))
    save_file({n: t for n, t in weights.items() if ".mlp." not in n}, str(moe / "model.safetensors"))
    with caplog.at_level("WARNING", logger="peagle_ray.drafter"):
        _, drafter, _, _ = make(moe, records, init_from_target=-1)
    last = read_target_info(moe).num_layers - 1
    assert f"model.layers.{last}.mlp.gate_proj.weight" in caplog.text
    assert torch.equal(
        drafter.layers[0].self_attn.o_proj.weight, weights[f"model.layers.{last}.self_attn.o_proj.weight"]
    )
    assert not torch.equal(drafter.layers[0].mlp.down_proj.weight, weights[f"model.layers.{last}.mlp.down_proj.weight"])


def test_init_from_target_names_the_layers_it_would_need():
    assert target_layers_for(30, -1, 1) == [29] and target_layers_for(30, -2, 2) == [28, 29]
    assert target_layers_for(30, 15, 1) == [15]
    with pytest.raises(ConfigError, match=r"drafter\.init_from_target = 29: drafter layers 0\.\.1 would start "
                       r"from target layers \[29, 30\], but the target has layers 0\.\.29"):  # fmt: skip
        target_layers_for(30, 29, 2)


def test_tied_target_head_is_its_embedding(tmp_path):
    tied = build_tiny_target(tmp_path, TinyTargetSpec(num_layers=4, tie_embeddings=True))
    embed, lm_head, _ = target_head(tied)
    assert torch.equal(embed, lm_head)


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
def test_a_few_steps_reduce_the_loss(tiny_target, records, algorithm):
    cfg, drafter, teacher, _ = make(tiny_target, records, algorithm=algorithm)
    sequences = [TrainSequence.from_record(*r) for r in records]
    history = train_drafter(drafter, teacher, sequences, cfg.drafter, cfg.training, torch.Generator().manual_seed(1))
    losses = [h.loss for h in history]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert history[-1].segments >= 2  # segment_length 40 splits these sequences


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3"])
@pytest.mark.slow
def test_bfloat16_autocast_trains_and_tracks_float32(tiny_target, records, algorithm):
    """training.precision = bfloat16 (the GPU setting) runs the same step under autocast: the first loss is
    float32's within bf16 rounding, the loss falls, and weights and gradients stay float32."""
    sequences = [TrainSequence.from_record(*r) for r in records]
    losses = {}
    for precision in ("float32", "bfloat16"):
        cfg, drafter, teacher, _ = make(tiny_target, records, algorithm=algorithm)
        cfg.training.precision = precision
        history = train_drafter(
            drafter, teacher, sequences, cfg.drafter, cfg.training, torch.Generator().manual_seed(1)
        )
        losses[precision] = [h.loss for h in history]
        assert all(p.dtype == torch.float32 for p in drafter.parameters())
    assert losses["bfloat16"][0] == pytest.approx(losses["float32"][0], rel=0.05)
    assert sum(losses["bfloat16"][-3:]) < 0.8 * sum(losses["bfloat16"][:3]), losses["bfloat16"]


def test_pinned_loss_trajectory(tiny_target, records):
    """Fixed seeds, fixed init, fixed data: the first steps' losses are pinned (catches silent changes)."""
    cfg, drafter, teacher, _ = make(tiny_target, records)
    sequences = [TrainSequence.from_record(*r) for r in records]
    history = train_drafter(
        drafter, teacher, sequences, cfg.drafter, cfg.training, torch.Generator().manual_seed(1), steps=4
    )
    assert [round(h.loss, 4) for h in history] == pytest.approx(PINNED, abs=2e-4)


PINNED = [
    1.0597,
    1.079,
    0.777,
    0.5771,
]  # since drafter.frozen defaults to [embed_tokens]: was 1.0597, 1.079, 0.7797, 0.5755 (embeddings trained);
# since transformers warm-up (lr 0 at step 0): was 1.0597, 0.7509, 0.7009, 0.5987


def test_feature_noise_moves_only_the_inputs_within_its_bound(records):
    from peagle_ray.train.step import with_feature_noise

    seq = TrainSequence.from_record(*records[0])
    noisy = with_feature_noise(seq, 0.1, torch.Generator().manual_seed(0))
    bound = 0.1 * float(seq.hidden.std())
    delta = noisy.hidden - seq.hidden
    assert 0.9 * bound < float(delta.abs().max()) <= bound and abs(float(delta.mean())) < 0.05 * bound
    assert noisy.teacher_hidden is seq.teacher_hidden and torch.equal(noisy.tokens, seq.tokens)


def test_init_from_an_eagle3_export_copies_every_shared_tensor(tiny_target, records, tmp_path):
    from peagle_ray.drafter.build import load_initial_weights
    from peagle_ray.export.speculators import export_drafter

    _, eagle3, _, _ = make(tiny_target, records, algorithm="eagle3")
    with torch.no_grad():
        eagle3.fc.weight.add_(1.0)  # "trained"
    source = export_drafter(eagle3, tmp_path / "eagle3", tiny_target, [2, 3, 5], 3)
    _, peagle, _, _ = make(tiny_target, records)
    fresh_mask = peagle.mask_hidden.detach().clone()
    copied = load_initial_weights(peagle, source)
    assert "fc.weight" in copied and "mask_hidden" not in copied and "layers.0.self_attn.q_proj.weight" in copied
    assert torch.equal(peagle.fc.weight, eagle3.fc.weight) and torch.equal(peagle.mask_hidden, fresh_mask)
    other = build_config({"drafter": {"num_depths": 3, "draft_vocab_size": 64}})
    shuffled, _, _ = drafter_for_target(
        tiny_target, other.drafter, torch.arange(516.0), 3, torch.Generator().manual_seed(0)
    )
    with pytest.raises(ValueError, match="draft vocabulary differs"):
        load_initial_weights(shuffled, source)
    with pytest.raises(FileNotFoundError, match="training.init_from must be an exported drafter"):
        load_initial_weights(peagle, tmp_path)
