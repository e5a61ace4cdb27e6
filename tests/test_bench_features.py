"""bench features' pure parts: skip-gram count tables, the elements of a depth, feature ablations, layer stats."""

import torch

from peagle_ray.bench.features import depth_pairs, layer_statistics, predict, skipgram_table, with_features


def test_skipgram_table_predicts_each_inputs_most_frequent_label():
    table = skipgram_table(torch.tensor([1, 1, 1, 2, 3, 3]), torch.tensor([5, 5, 6, 7, 9, 8]))
    keys, predictions, fallback = table
    assert keys.tolist() == [1, 2, 3] and predictions.tolist() == [5, 7, 8]  # 3: a tie, the smaller label
    assert fallback == 5
    assert predict(table, torch.tensor([3, 1, 4, 2, 0])).tolist() == [8, 5, 5, 7, 5]  # 4 and 0 never seen


def test_depth_pairs_score_the_label_depth_positions_later_where_supervised():
    tokens, labels = torch.tensor([10, 11, 12]), torch.tensor([20, 21, 22])
    supervised = torch.tensor([1, 1, 0])
    assert [t.tolist() for t in depth_pairs(tokens, labels, supervised, 0)] == [[10, 11], [20, 21]]
    assert [t.tolist() for t in depth_pairs(tokens, labels, supervised, 1)] == [[10], [21]]
    assert [t.tolist() for t in depth_pairs(tokens, labels, supervised, 3)] == [[], []]


def test_feature_ablations_zero_or_permute_positions_and_keep_the_rest():
    aux = torch.arange(12.0).reshape(4, 3)
    [zeroed] = with_features([{"aux_hidden": aux, "input_ids": [1]}], "zeroed", 0)
    [shuffled] = with_features([{"aux_hidden": aux}], "shuffled", 0)
    assert zeroed["aux_hidden"].abs().sum() == 0 and zeroed["input_ids"] == [1]
    assert not torch.equal(shuffled["aux_hidden"], aux)
    assert sorted(map(tuple, shuffled["aux_hidden"].tolist())) == sorted(map(tuple, aux.tolist()))  # rows moved


def test_layer_statistics_find_the_massive_channel():
    aux = torch.ones(8, 6)  # 2 aux layers of 3 channels
    aux[3, 4] = -300.0  # layer 2, channel 1
    first, second = layer_statistics([{"aux_hidden": aux}], [3, 7], top=2)
    assert first["layer"] == 3 and first["max_abs"] == 1.0 and first["max_over_median_rms"] == 1.0
    assert second["top_channels"][0] == [1, 300.0] and second["max_over_median_rms"] == 300.0


def test_attention_on_anchor_of_a_drafter_that_cannot_tell_keys_apart_is_uniform():
    from peagle_ray.bench.features import attention_on_anchor
    from peagle_ray.drafter.model import Drafter, DrafterArch
    from peagle_ray.train.elements import TrainSequence

    arch = DrafterArch(
        algorithm="peagle", num_depths=3, num_layers=1, num_aux=3, draft_vocab_size=16, mask_token_id=15,
        hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=16,
        rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    drafter = Drafter(arch)
    with torch.no_grad():
        drafter.layers[0].self_attn.q_proj.weight.zero_()  # every score 0: weight 1 / visible keys
    seq = TrainSequence(
        tokens=torch.tensor([1, 2, 3, 4]),
        hidden=torch.randn(4, 24),
        teacher_hidden=torch.randn(4, 8),
        supervised=torch.ones(4, dtype=torch.bool),
        doc_ids=torch.zeros(4, dtype=torch.long),
    )
    result = attention_on_anchor(drafter, seq, 3)
    # depth 0 at anchor a sees a + 1 keys; depth 1 (anchors 0..2) a + 2; depth 2 (anchors 0, 1) a + 3
    expected = [(1 + 1 / 2 + 1 / 3 + 1 / 4) / 4, (1 / 2 + 1 / 3 + 1 / 4) / 3, (1 / 3 + 1 / 4) / 2]
    assert result["uniform"] == [round(e, 4) for e in expected]
    assert result["mean"] == result["uniform"] and result["best_head"] == result["uniform"]
