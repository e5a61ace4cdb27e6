"""Drafter forward, chunked KL loss, partitioned == unpartitioned gradients, drafting with a KV cache."""

import math

import pytest
import torch

from peagle_ray.drafter.elements import Elements, attention_mask
from peagle_ray.drafter.model import DraftCache, DrafterArch
from peagle_ray.drafter.teacher import Teacher
from peagle_ray.train.elements import cod_sample
from peagle_ray.train.loss import kl_loss, kl_loss_reference
from peagle_ray.train.step import element_weights, mask_function, sequence_backward
from tests.drafter_helpers import DRAFT_VOCAB, HIDDEN, random_sequence, tiny_arch, tiny_drafter


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_arch_validates_its_fields():
    with pytest.raises(ValueError, match="mask_token_id is required for algorithm 'peagle'; got None"):
        tiny_arch(mask_token_id=None)
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in 1\.\.37; got 40"):
        tiny_arch(draft_vocab_size=40)
    arch = tiny_arch("eagle3", num_layers=2)
    assert DrafterArch.from_json(arch.to_json()) == arch


def test_weight_names_follow_the_speculators_layout():
    drafter, _ = tiny_drafter(tiny_arch(num_layers=2))
    shapes = {n: tuple(t.shape) for n, t in drafter.state_dict().items()}
    assert shapes["embed_tokens.weight"] == (37, 24)
    assert shapes["fc.weight"] == (24, 72)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (24, 48)  # layer 0 reads [embedding; hidden]
    assert shapes["layers.1.self_attn.q_proj.weight"] == (24, 24)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (8, 48)
    assert "layers.0.hidden_norm.weight" in shapes and "layers.1.hidden_norm.weight" not in shapes
    assert shapes["lm_head.weight"] == (29, 24)
    assert shapes["mask_hidden"] == (1, 1, 72)
    assert shapes["d2t"] == (29,) and shapes["t2d"] == (37,)
    assert drafter.embed_tokens.weight.requires_grad  # P-EAGLE learns the mask token's embedding
    eagle3, _ = tiny_drafter(tiny_arch("eagle3"))
    assert not eagle3.embed_tokens.weight.requires_grad and not hasattr(eagle3, "mask_hidden")


def test_element_weights_average_each_depth_then_the_depths():
    seq = random_sequence([6], supervised_from=0)
    elements = Elements(torch.tensor([0, 1, 2, 0]), torch.tensor([0, 0, 0, 1]))
    assert element_weights(elements, seq, 2, None).tolist() == pytest.approx([1 / 6, 1 / 6, 1 / 6, 1 / 2])
    assert element_weights(elements, seq, 2, [3.0, 1.0]).tolist() == pytest.approx([1 / 4, 1 / 4, 1 / 4, 1 / 4])


@pytest.mark.parametrize("loss_kind", ["kl", "argmax_ce"])
def test_chunked_kl_equals_the_plain_loss_in_value_and_gradient(loss_kind):
    g = torch.Generator().manual_seed(0)
    _, teacher = tiny_drafter(tiny_arch())
    x = torch.randn(11, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(DRAFT_VOCAB, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(6, HIDDEN, generator=g, dtype=torch.float64)
    index = torch.tensor([3, 0, 5, 3, 1, 3, 0, 4, 4, 5, 3])  # positions shared by several elements, unsorted
    weights = torch.rand(11, generator=g, dtype=torch.float64)
    loss, kl, correct = kl_loss(x, w, t, index, teacher, weights, chunk=4, loss=loss_kind)
    loss.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    reference = kl_loss_reference(x, w, t, index, teacher, weights, loss_kind)
    reference.backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    assert (kl >= 0).all() and correct.dtype == torch.bool
    plain_kl = [
        float(kl_loss_reference(x[i : i + 1], w, t, index[i : i + 1], teacher, torch.ones(1), loss_kind))
        for i in range(11)
    ]
    torch.testing.assert_close(kl, torch.tensor(plain_kl, dtype=torch.float64))  # each element its own row


def test_argmax_ce_is_the_cross_entropy_of_the_targets_greedy_token():
    """training.loss = argmax_ce, literally: draft logits [0, ln 3] (q = [1/4, 3/4]), the target's argmax is
    token 0, so the loss is -ln(1/4) whatever the rest of the target's distribution; KL(p || q) is not."""
    teacher = Teacher(torch.ones(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64), 1e-12)
    w = torch.eye(2, dtype=torch.float64)
    x = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    for target in ([1.0, 0.5], [1.0, 0.9]):  # normed: argmax 0 both times, different distributions
        t = torch.tensor([target], dtype=torch.float64)
        ce, _, correct = kl_loss(
            x, w, t, torch.tensor([0]), teacher, torch.ones(1, dtype=torch.float64), loss="argmax_ce"
        )
        assert float(ce) == pytest.approx(math.log(4.0)) and not correct.item()
    kl = [float(kl_loss(x, w, torch.tensor([t], dtype=torch.float64), torch.tensor([0]), teacher,
                        torch.ones(1, dtype=torch.float64))[0]) for t in ([1.0, 0.5], [1.0, 0.9])]  # fmt: skip
    assert kl[0] != pytest.approx(kl[1])


def test_a_frozen_head_gets_no_gradient_and_the_same_hidden_gradient():
    g = torch.Generator().manual_seed(1)
    _, teacher = tiny_drafter(tiny_arch())
    x = torch.randn(7, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(DRAFT_VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    t, index, weights = torch.randn(4, HIDDEN, dtype=torch.float64), torch.tensor([0, 1, 1, 2, 3, 3, 3]), torch.ones(7)
    kl_loss(x, w, t, index, teacher, weights.double(), chunk=3)[0].backward()
    frozen = x.grad.clone()
    x.grad = None
    kl_loss_reference(x, w, t, index, teacher, weights.double()).backward()
    torch.testing.assert_close(frozen, x.grad)


def test_kl_is_zero_when_draft_equals_target():
    _, teacher = tiny_drafter(tiny_arch())
    t = torch.randn(5, HIDDEN, dtype=torch.float64)
    loss, kl, correct = kl_loss(
        teacher.normed(t), teacher.head, t, torch.arange(5), teacher, torch.ones(5, dtype=torch.float64)
    )
    assert float(loss) == pytest.approx(0.0, abs=1e-12) and correct.all()


CASES = [
    # (algorithm, layers, document lengths, boundaries to try)
    ("peagle", 1, [31], [[0, 30], [0, 15, 30], [0, 4, 5, 21, 30], [0, 1, 2, 3, 29, 30]]),
    ("peagle", 2, [12, 9, 13], [[0, 31], [0, 10, 20, 31], [0, 11, 12, 31]]),
    ("eagle3", 1, [31], [[0, 30], [0, 15, 30], [0, 4, 5, 21, 30]]),
    ("eagle3", 2, [12, 9, 13], [[0, 31], [0, 10, 20, 31], [0, 11, 12, 31]]),
]


@pytest.mark.parametrize(("algorithm", "layers", "docs", "splits"), CASES)
def test_partitioned_step_equals_the_unpartitioned_step(algorithm, layers, docs, splits):
    arch = tiny_arch(algorithm, num_layers=layers, num_depths=4)
    seq = random_sequence(docs)
    elements = cod_sample(seq.supervised, seq.doc_ids, 4, 0.7, 0.2, torch.Generator().manual_seed(1))
    assert int(elements.depth.max()) == 3
    drafter, teacher = tiny_drafter(arch)
    whole = sequence_backward(drafter, teacher, seq, elements, 10**6, None, boundaries=splits[0])
    assert whole.segments == 1
    expected = grads(drafter)
    for boundaries in splits[1:]:
        drafter.zero_grad(set_to_none=True)
        parts = sequence_backward(drafter, teacher, seq, elements, 10**6, None, boundaries=boundaries)
        assert parts.segments == len(boundaries) - 1
        assert parts.loss == pytest.approx(whole.loss, rel=1e-12)
        assert parts.depth_correct == whole.depth_correct and parts.depth_count == whole.depth_count
        got = grads(drafter)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], msg=f"{name} with boundaries {boundaries}")


def test_balanced_partition_equals_unpartitioned_with_depth_weights():
    arch = tiny_arch("peagle", num_layers=1, num_depths=4)
    seq = random_sequence([40, 25])
    elements = cod_sample(seq.supervised, seq.doc_ids, 4, 0.7, 0.2, torch.Generator().manual_seed(2))
    drafter, teacher = tiny_drafter(arch)
    whole = sequence_backward(drafter, teacher, seq, elements, 10**6, [1.0, 0.8, 0.6, 0.4])
    expected = grads(drafter)
    drafter.zero_grad(set_to_none=True)
    parts = sequence_backward(drafter, teacher, seq, elements, 40, [1.0, 0.8, 0.6, 0.4])
    assert parts.segments >= 3
    assert parts.loss == pytest.approx(whole.loss, rel=1e-12)
    for name, g in grads(drafter).items():
        torch.testing.assert_close(g, expected[name])


def test_flex_attention_forward_equals_sdpa():
    """The GPU path (flex attention + BlockMask) computes the same outputs; forward only (CPU)."""
    arch = tiny_arch("peagle", num_layers=2, num_depths=3)
    seq = random_sequence([20, 17], dtype=torch.float32)
    elements = cod_sample(seq.supervised, seq.doc_ids, 3, 0.7, 0.2, torch.Generator().manual_seed(0))
    drafter, _ = tiny_drafter(arch, dtype=torch.float32)
    with torch.no_grad():
        dense = drafter.forward_elements(
            seq.tokens, seq.hidden, elements, mask_function(elements, seq.doc_ids, False), 0
        )
        flex = drafter.forward_elements(seq.tokens, seq.hidden, elements, mask_function(elements, seq.doc_ids, True), 0)
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)


def reference_chain_logits(drafter, tokens, aux, k):
    """Logits of the chain anchored at the last position, from the training forward (no cache)."""
    n = tokens.shape[0]
    elements = Elements.cat(
        [
            Elements(torch.arange(n), torch.zeros(n, dtype=torch.long)),
            Elements(torch.full((k - 1,), n - 1), torch.arange(1, k)),
        ]
    )
    one_doc = torch.zeros(n + k, dtype=torch.long)
    mask_fn = lambda rows, cols: attention_mask(elements.select(rows), elements.select(cols), one_doc)  # noqa: E731
    with torch.no_grad():
        out = drafter.forward_elements(tokens, aux, elements, mask_fn)
    return drafter.logits(out[n - 1 :])


@pytest.mark.parametrize("layers", [1, 2])
def test_peagle_propose_with_cache_equals_the_training_forward(layers):
    drafter, _ = tiny_drafter(tiny_arch("peagle", num_layers=layers, num_depths=4))
    seq = random_sequence([20])
    cache = DraftCache(layers)
    drafter.propose(cache, seq.tokens[:12], seq.hidden[:12], 4)  # prefill, first proposal
    assert cache.length == 12
    draft = drafter.propose(cache, seq.tokens[12:17], seq.hidden[12:17], 4)  # 5 accepted/new positions
    assert cache.length == 17
    expected = reference_chain_logits(drafter, seq.tokens[:17], seq.hidden[:17], 4).argmax(-1)
    assert draft.tolist() == (expected + drafter.d2t[expected]).tolist()


@pytest.mark.parametrize("layers", [1, 2])
def test_eagle3_propose_with_cache_equals_the_training_forward(layers):
    k = 4
    drafter, _ = tiny_drafter(tiny_arch("eagle3", num_layers=layers, num_depths=k))
    seq = random_sequence([20])
    cache = DraftCache(layers)
    drafter.propose(cache, seq.tokens[:9], seq.hidden[:9], k)
    draft = drafter.propose(cache, seq.tokens[9:15], seq.hidden[9:15], k)
    # training-time test feeds the true next tokens; feed the drafted ones to compare
    tokens = torch.cat([seq.tokens[:15], draft[: k - 1]])
    n = 15
    elements = Elements.cat(
        [Elements(torch.arange(n), torch.zeros(n, dtype=torch.long))]
        + [Elements(torch.tensor([n - 1]), torch.tensor([d])) for d in range(1, k)]
    )
    one_doc = torch.zeros(n + k, dtype=torch.long)
    mask_fn = lambda rows, cols: attention_mask(elements.select(rows), elements.select(cols), one_doc)  # noqa: E731
    with torch.no_grad():
        out = drafter.forward_elements(tokens, seq.hidden[:n], elements, mask_fn)
    expected = drafter.logits(out[n - 1 :]).argmax(-1)
    assert draft.tolist() == (expected + drafter.d2t[expected]).tolist()


def test_the_learning_rate_warms_up_from_zero_then_decays_by_cosine():
    from peagle_ray.config import TrainingConfig
    from peagle_ray.train.step import make_optimizer

    drafter, _ = tiny_drafter(tiny_arch())
    optimizer, scheduler = make_optimizer(drafter, TrainingConfig(learning_rate=1.0, warmup_steps=2, max_steps=6))
    lrs = []
    for _ in range(6):
        lrs.append(round(scheduler.get_last_lr()[0], 4))
        optimizer.step()
        scheduler.step()
    assert lrs == [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464]


@pytest.mark.slow  # importing transformers.optimization: ~7 s
@pytest.mark.parametrize("warmup, total", [(0, 5), (2, 6), (10, 4), (3, 3), (7, 100)])
def test_warmup_cosine_is_transformers_schedule_value_for_value(warmup, total):
    from transformers import get_cosine_schedule_with_warmup

    from peagle_ray.train.step import warmup_cosine

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_cosine_schedule_with_warmup(optimizer, warmup, total).lr_lambdas[0]
    steps = range(total + 3)  # past the end too (0 there)
    assert [warmup_cosine(s, warmup, total) for s in steps] == [theirs(s) for s in steps]


@pytest.mark.parametrize(
    "algorithm, expected",
    [("peagle", [3.032077, 3.718851, 2.630405, 2.698207]), ("eagle3", [3.852658, 3.746392, 3.401128, 3.088501])],
)
def test_pinned_loss_trajectory_of_four_steps(algorithm, expected):
    """Seeded tiny drafter, two packed sequences, partitioned (segment 10), float64: the losses of four steps.
    Any change to COD, masks, partitioning, the loss or the optimizer moves these numbers."""
    from peagle_ray.config import DrafterConfig, TrainingConfig
    from peagle_ray.train.step import train_drafter

    drafter, teacher = tiny_drafter(tiny_arch(algorithm))
    sequences = [random_sequence([9, 7], seed=1), random_sequence([12], seed=2)]
    tcfg = TrainingConfig(learning_rate=1e-2, warmup_steps=1, max_steps=4, sequences_per_step=1, segment_length=10)
    history = train_drafter(
        drafter,
        teacher,
        sequences,
        DrafterConfig(algorithm=algorithm, num_depths=3),
        tcfg,
        torch.Generator().manual_seed(0),
    )
    assert [round(s.loss, 6) for s in history] == expected


def test_frozen_prefixes_keep_their_values_while_the_rest_trains():
    from peagle_ray.config import ConfigError, DrafterConfig, TrainingConfig
    from peagle_ray.drafter.build import freeze
    from peagle_ray.train.step import train_drafter

    drafter, teacher = tiny_drafter(tiny_arch())
    freeze(drafter, ["embed_tokens", "fc"])
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    tcfg = TrainingConfig(learning_rate=1e-2, warmup_steps=0, max_steps=2, segment_length=10)
    sequences = [random_sequence([9, 7], seed=1)]
    train_drafter(drafter, teacher, sequences, DrafterConfig(num_depths=3), tcfg, torch.Generator().manual_seed(0))
    changed = {n for n, p in drafter.named_parameters() if not torch.equal(p, before[n])}
    assert not changed & {"embed_tokens.weight", "fc.weight"}
    assert {"mask_hidden", "layers.0.self_attn.q_proj.weight", "norm.weight"} <= changed
    with pytest.raises(ConfigError, match="drafter.frozen: 'decoder' names no parameter"):
        freeze(drafter, ["decoder"])


def test_feature_scale_keeps_the_function_and_the_export_folds_it_into_fc(tmp_path):
    from safetensors.torch import load_file, save_file

    from peagle_ray.config import TrainingConfig
    from peagle_ray.drafter.build import channel_scale
    from peagle_ray.export.speculators import drafter_state
    from peagle_ray.train.checkpoint import CHECKPOINT_WEIGHTS, load_drafter_from_checkpoint, save_checkpoint
    from peagle_ray.train.step import make_optimizer

    assert channel_scale([torch.tensor([[3.0, 0.0], [-3.0, 0.0]])]).tolist() == pytest.approx([1 / 3, 1000.0])
    drafter, _ = tiny_drafter(tiny_arch("peagle", num_depths=4))
    seq = random_sequence([20])
    before = reference_chain_logits(drafter, seq.tokens, seq.hidden, 4)
    scale = torch.linspace(0.01, 10.0, seq.hidden.shape[1], dtype=torch.float64)
    drafter.set_feature_scale(scale)
    assert torch.equal(drafter.feature_scale, scale)
    torch.testing.assert_close(reference_chain_logits(drafter, seq.tokens, seq.hidden, 4), before)
    state = drafter_state(drafter)
    assert "feature_scale" not in state  # vLLM's fc reads the raw features
    torch.testing.assert_close(seq.hidden[:3] @ state["fc.weight"].T, drafter.project(seq.hidden[:3]))
    # a checkpoint keeps the scale; one written before it existed loads with the identity scale
    optimizer, scheduler = make_optimizer(drafter, TrainingConfig())
    save_checkpoint(tmp_path, drafter, optimizer, scheduler, torch.Generator(), {"step": 1})
    assert torch.equal(load_drafter_from_checkpoint(tmp_path).feature_scale, scale.float())
    weights = load_file(str(tmp_path / CHECKPOINT_WEIGHTS))
    weights.pop("feature_scale")
    save_file(weights, str(tmp_path / CHECKPOINT_WEIGHTS))
    assert torch.equal(load_drafter_from_checkpoint(tmp_path).feature_scale, torch.ones_like(scale).float())
