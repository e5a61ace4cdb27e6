"""The in-process benchmarks on the session's captured tiny data (conftest's `captured_data`): ablation,
features, peers (ours and the reference trainer, then stock vLLM) and the learning curve, each run with the
job's own step and validation."""

from peagle_ray.bench import features, learning, peers
from peagle_ray.config import with_values
from peagle_ray.export.speculators import export_drafter
from peagle_ray.train.job import check_inputs
from tests.helpers.mlflow_store import mlflow_client
from tests.helpers.train_data import K, config


def test_ablation_trains_variants_in_process(captured_data, tiny_target):
    cfg = config(captured_data, tiny_target)
    variants = {"base": [], "frozen": ["drafter.freeze_lm_head=true"], "norm": ["drafter.normalize_features=true"]}
    result = learning.ablation(cfg, variants, steps=3, progress=lambda _line: None)
    base, frozen = result["variants"]["base"], result["variants"]["frozen"]
    assert result["variants"]["norm"]["train_loss"] != base["train_loss"]  # the same start, other steps
    assert base["trainable_parameters"] - frozen["trainable_parameters"] == 300 * 96  # the DV x H head
    assert base["steps"] == 3 and base["train_tokens"] > 0 and base["val_al_gain_vs_baseline"] == 0
    assert all(
        1 <= r["val_acceptance_length"] <= K + 1 and len(r["val_acceptance_per_position"]) == K
        for r in result["variants"].values()
    )


def test_features_on_an_exported_drafter(captured_data, tiny_target):
    """Its features as captured, zeroed, shuffled; count tables; layers."""
    workdir, cfg = captured_data, config(captured_data, tiny_target)
    drafter, _ = learning.initial_drafter(cfg)
    export = export_drafter(drafter, workdir / "features-drafter", tiny_target, check_inputs(cfg).aux_layer_ids, K)
    diagnosis = features.run(cfg, {"peagle": export}, validation_records=2, progress=lambda _line: None)
    assert (
        set(diagnosis["features"]) == {"captured", "zeroed", "shuffled"}
        and 1 <= diagnosis["records"]["validation"] <= 2
    )
    for row in diagnosis["features"].values():
        assert len(row["acc_by_depth"]) == K and all(0 <= a <= 1 for a in row["acc_by_depth"])
        assert 1 <= row["acceptance_length"] <= K + 1
    assert len(diagnosis["counts"]["acc_by_depth"]) == K and 0 <= diagnosis["counts"]["acc_by_depth"][0] <= 1
    assert [row["layer"] for row in diagnosis["layers"]] == list(check_inputs(cfg).aux_layer_ids)
    assert all(row["max_abs"] > 0 for row in diagnosis["layers"])


def curve_config(workdir, tiny_target):
    return with_values(
        config(workdir, tiny_target),
        {
            "eval.suite": "mt-bench",
            "eval.prompts_per_category": 1,
            "eval.max_new_tokens": 8,
            "target.max_model_len": 1024,
        },
    )


def test_peers_train_ours_and_the_reference_on_the_same_shards_and_measure_them_in_vllm(captured_data, tiny_target):
    curve_cfg = curve_config(captured_data, tiny_target)
    side = peers.run(curve_cfg, steps=2, algorithms=["peagle"], suites=["mt-bench"], prompts=2, timed=1, ngram_k=[2])
    assert side["training"]["peagle"]["train_tokens"] == side["training"]["reference"]["train_tokens"]  # same data
    rows = side["suites"]["mt-bench"]
    assert {"target", "peagle", "reference", "ngram-k2", "suffix", "hybrid"} <= set(rows)
    for name in ("peagle", "reference", "ngram-k2", "suffix", "hybrid"):  # suffix decoding: built by `make setup`
        assert rows[name]["greedy_mismatches"] == 0 and 1 <= rows[name]["acceptance_length"] <= K + 1
    assert sum(source["drafts"] for source in rows["hybrid"]["by_source"].values()) > 0
    assert "mt-bench_hybrid_speed_within_spread" in side["goals"]
    assert side["ngram_best"]["mt-bench"] == "ngram-k2" and "mt-bench_al_vs_reference" in side["goals"]
    assert peers.log_to_mlflow(curve_cfg, side)["bench-peers"]


def test_the_learning_curve_measures_each_budget_in_vllm_and_logs_a_finished_run(captured_data, tiny_target):
    workdir, cfg = captured_data, config(captured_data, tiny_target)
    curve_cfg = curve_config(workdir, tiny_target)
    curve = learning.learning_curve(curve_cfg, [2, 1], ["peagle"], workdir / "curve", progress=lambda _line: None)
    rows = curve["curves"]["peagle"]
    assert [r["steps"] for r in rows] == [1, 2] and rows[0]["train_tokens"] < rows[1]["train_tokens"]
    assert all(
        1 <= r["suite_acceptance_length"] <= K + 1 and len(r["suite_acceptance_per_position"]) == K for r in rows
    )
    assert (workdir / "curve" / "learning_curve.png").stat().st_size > 0

    runs = learning.log_to_mlflow(cfg, curve, workdir / "curve")
    client = mlflow_client(cfg.tracking.tracking_uri)
    run = client.get_run(runs["peagle"])
    assert run.info.status == "FINISHED" and run.data.tags["peagle.run_name"] == "curve-peagle"
    steps = [m.step for m in client.get_metric_history(runs["peagle"], "curve/suite_acceptance_length")]
    assert steps == [r["train_tokens"] for r in rows]
    assert "curve/learning_curve.png" in [a.path for a in client.list_artifacts(runs["peagle"], "curve")]


def test_the_learning_curve_compares_recipes_side_by_side(captured_data, tiny_target):
    """--variant: one curve per recipe on the same data and budgets (issue 38's today against from-the-target),
    the from-the-target recipe trains more depths than it serves and validates at the served K; budget 0 is
    the untrained drafter."""
    cfg = with_values(config(captured_data, tiny_target), {"eval.suite": "validation"})
    recipes = {"today": [], "target": ["drafter.init_from_target=-1", f"drafter.k_train={K + 1}"]}
    curve = learning.learning_curve(cfg, [0, 1, 2], variants=recipes, work_dir=captured_data / "recipes",
                                    progress=lambda _line: None)  # fmt: skip
    assert list(curve["curves"]) == ["today", "target"] and curve["recipes"] == recipes
    today, target = curve["curves"]["today"], curve["curves"]["target"]
    assert [r["steps"] for r in target] == [0, 1, 2] and target[0]["train_tokens"] == 0  # 0: untrained
    assert target[1]["train_loss"] != today[1]["train_loss"]
    assert len(target[1]["val_acceptance_per_position"]) == K and len(target[1]["val_acc_by_depth"]) == K + 1
