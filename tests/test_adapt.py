"""The adaptation loop: its rules on literal rows, then the loop end to end inside the demo's run on the tiny
Llama-3 target, run once (tests/helpers/demo_loop.py, the session's `demo_loop`) and checked part by part: the
endpoint records its traffic, `adapt` fine-tunes the registered drafter on it, judges both versions with
stock vLLM, registers and promotes the new one and swaps it into the running endpoint while requests keep
flowing; a drafter that cannot load is refused; the endpoint switches to the hybrid under load."""

import json
import shutil
from pathlib import Path

import pytest

from peagle_ray.adapt import (
    Judged,
    Verdict,
    decide,
    decoder_metrics,
    epochs_for,
    gain_error,
    regression_error,
    run_adapt,
    serve_adapting,
)
from peagle_ray.config import ConfigError, build_config
from peagle_ray.eval.metrics import pick_decoder
from tests.helpers.demo_workload import DEMO_REQUESTS, REPEATS, WORKLOAD, K
from tests.helpers.mlflow_store import mlflow_client

# the session's demo run, stage by stage (conftest: demo_recorded, demo_adapted, demo_loop): each stage's setup
# counts against the first test that needs it (this file's, first in its xdist group), so the tests below come
# in the order of the stages they check; over the 900 s default on a slow day
pytestmark = pytest.mark.timeout(1800)


def judged(heldout_al, general_al, wrong=0, by_category=(), requests=None):
    """A version's judged rows; `requests`: its held-out per-request ALs (default: 3 requests at heldout_al)."""
    row = lambda al: {"acceptance_length": al, "greedy_mismatches": wrong}  # noqa: E731
    heldout = {**row(heldout_al), "prompt_acceptance_lengths": list(requests or [heldout_al] * 3)}
    return Judged(heldout, row(general_al), dict(enumerate(by_category)))


def test_promotion_rule():
    cfg = build_config({"adapt": {"min_gain": 0.05, "max_regression": 0.02}})
    parent = judged(1.2, 1.18)
    assert decide(cfg, parent, judged(1.65, 1.17)) == Verdict(
        gain=0.45,
        regression=0.01,
        promote=True,
        why="held-out gain +0.450 +- 0.000 and general-suite loss within bounds",
    )
    held = decide(cfg, parent, judged(1.22, 1.1))
    assert not held.promote and "gain +0.020 < adapt.min_gain 0.05" in held.why
    assert "mt-bench AL loss 0.080 > adapt.max_regression 0.02" in held.why
    assert "greedy outputs differ" in decide(cfg, parent, judged(2, 1.2, wrong=1)).why


def test_a_planted_tie_is_never_promoted():
    """Stop 44's case: promoted at +0.0502 with no error bar. The same overall gain over requests that gain
    and lose by turns is noise, not evidence; under 2 timed requests the verdict says it has no error bar."""
    cfg = build_config({"adapt": {"min_gain": 0.05}})
    parent = judged(1.25, 1.2, requests=[1.0, 1.5, 1.2, 1.3])
    tie = judged(1.3002, 1.2, requests=[1.5, 1.2, 1.6, 0.9])  # per request +0.5 -0.3 +0.4 -0.4
    verdict = decide(cfg, parent, tie)
    assert not verdict.promote and verdict.gain == 0.0502
    assert "held-out AL gain +0.050 is within 2 standard errors (+- 0.233) of zero" in verdict.why
    assert gain_error(parent, tie) == pytest.approx(0.2327, abs=1e-4)
    steady = judged(1.3002, 1.2, requests=[1.06, 1.55, 1.24, 1.35])  # +0.06 +0.05 +0.04 +0.05: measurable
    assert decide(cfg, parent, steady).promote
    # one timed held-out request: no error bar to clear, min_gain alone decides, and the reason says so
    unmeasured = decide(cfg, judged(1.25, 1.2, requests=[1.2]), judged(1.5, 1.2, requests=[1.5]))
    assert unmeasured.promote and "(no error bar: under 2 held-out requests timed)" in unmeasured.why


def test_a_general_suite_loss_within_its_noise_is_not_forgetting():
    cfg = build_config({"adapt": {"min_gain": 0.05, "max_regression": 0.02}})

    def general(heldout_al, *by_category):
        return judged(heldout_al, sum(by_category) / len(by_category), by_category=by_category)

    assert regression_error(general(1.2, 1.2, 1.3), general(1.2, 1.1, 1.3)) == pytest.approx(0.05)
    assert regression_error(judged(1.2, 1.2), general(1.2, 1.2)) is None
    parent = general(1.2, 1.20, 1.30, 1.10, 1.25)
    # a 0.04 loss, but per category +0.12 ... -0.02: 2 standard errors (0.06) cover it -> promoted
    noisy = decide(cfg, parent, general(1.3, 1.08, 1.27, 1.12, 1.22))
    assert noisy.promote and noisy.regression == pytest.approx(0.04)
    # the same 0.04 lost evenly in every category is measurable forgetting -> held back, saying so
    steady = decide(cfg, parent, general(1.3, 1.16, 1.26, 1.06, 1.21))
    assert not steady.promote and "mt-bench AL loss 0.040 (+- 0.000 over its categories)" in steady.why


def test_the_decoders_judged_become_mlflow_metrics_per_source_too():
    from types import SimpleNamespace

    decoders = {
        "drafter": {"acceptance_length": 1.2, "speedup": 0.9},
        "hybrid": {
            "acceptance_length": 2.0,
            "speedup": None,
            "by_source": {"suffix": {"drafts": 3, "accepted_tokens": 5, "acceptance_length": 2.6}},
        },
        "suffix": {"failed": "engine exited"},
    }
    assert decoder_metrics(SimpleNamespace(decoders=decoders)) == {
        "adapt/decoder_drafter_al": 1.2,
        "adapt/decoder_drafter_speedup": 0.9,
        "adapt/decoder_hybrid_al": 2.0,
        "adapt/decoder_hybrid_speedup": 0.0,
        "adapt/hybrid_suffix_drafts": 3.0,
        "adapt/hybrid_suffix_accepted_tokens": 5.0,
        "adapt/hybrid_suffix_acceptance_length": 2.6,
    }


def test_adaptation_repeats_a_small_recording_enough_passes_for_its_steps():
    cfg = build_config({"adapt": {"max_steps": 120}, "training": {"sequences_per_step": 4, "num_workers": 1}})
    assert epochs_for(cfg, 18) == 27 and epochs_for(cfg, 10_000) == 1
    two = build_config({"adapt": {"max_steps": 10}, "training": {"sequences_per_step": 2, "num_workers": 2}})
    assert epochs_for(two, 7) == 7  # 20 records read from the smaller share, 3


def test_continuous_mode_needs_a_recording_and_a_period():
    with pytest.raises(ConfigError, match="--adapt-every needs traffic to learn from: set serving.record_dir"):
        serve_adapting(build_config({}), None, None, 5)
    with pytest.raises(ConfigError, match="--adapt-every must be a positive number of minutes; got 0"):
        serve_adapting(build_config({"serving": {"record_dir": "r"}}), None, None, 0)


def test_adapt_refuses_without_a_recording(tmp_path):
    with pytest.raises(ConfigError, match="set serving.record_dir .* or adapt.traffic_dir; got neither"):
        run_adapt(build_config({}))
    with pytest.raises(ConfigError, match="tracking.registered_model must be set"):
        run_adapt(build_config({"serving": {"record_dir": str(tmp_path)}, "tracking": {"registered_model": None}}))
    with pytest.raises(FileNotFoundError, match="holds no recorded traffic"):
        run_adapt(build_config({"serving": {"record_dir": str(tmp_path)}}))


def test_adapt_refuses_before_a_version_is_registered_and_with_too_little_traffic(demo_recorded):
    assert (
        "no version of registered model 'peagle-drafter' has the alias 'serving'" in demo_recorded.refusals["no alias"]
    )
    assert "too little new traffic" in demo_recorded.refusals["too little traffic"]
    assert "adapt.min_requests is 10000" in demo_recorded.refusals["too little traffic"]


def test_the_endpoint_records_the_workload_losslessly(demo_recorded):
    recorded = demo_recorded.recorded
    assert recorded.ok == len(WORKLOAD) * REPEATS and not recorded.failed and not recorded.mismatched


def test_adapt_trains_on_the_recording_and_the_replay_and_judges_losslessly(demo_adapted):
    report = demo_adapted.report
    assert report.parent_version == "1" and report.version == "2" and report.k == K
    prepared = json.loads((Path(report.json).parent / "data" / "summary.json").read_text())["by_category"]
    assert report.samples == prepared["traffic"] and sum(prepared["user"].values()) == 6  # replay trained too
    # the snapshot: the demo's workload and the narrow one, not the requests sent during adapt
    assert sum(report.samples.values()) == DEMO_REQUESTS + len(WORKLOAD) * REPEATS
    assert all(
        getattr(j, part)["greedy_mismatches"] == 0 for j in report.measured.values() for part in ("heldout", "general")
    )
    saved = json.loads(Path(report.json).read_text())
    assert saved["measured"]["new"]["general"]["by_category"] == report.measured["new"].general_by_category
    assert saved["promote"] == report.promote and saved["version"] == "2"


def test_the_adapted_drafter_accepts_the_repeated_requests_the_random_one_does_not(demo_adapted):
    # held-out requests repeat train prompts (the split is by conversation id, the same in every run): the
    # random parent accepts (almost) nothing, the adapted one learned them
    heldout = {who: judged.heldout for who, judged in demo_adapted.report.measured.items()}
    assert heldout["new"]["acceptance_per_position"][0] > 0, heldout
    assert heldout["new"]["acceptance_length"] > heldout["parent"]["acceptance_length"], heldout
    assert demo_adapted.report.promote, demo_adapted.report.verdict.why


def test_adapt_judges_suffix_decoding_and_the_hybrid_and_serves_what_the_measurements_pick(demo_adapted):
    # the held-out requests repeat recorded ones: suffix decoding, warmed up on the recorded training
    # requests, drafts whole answers; the random-then-adapted tiny drafter does not come close. Which is
    # fastest on the tiny target is the timing's to say (tests/test_eval.py plants a faster one)
    report = demo_adapted.report
    assert set(report.decoders) == {"target", "drafter", "suffix", "hybrid"}
    assert all(row["greedy_mismatches"] == 0 and row["timed_prompts"] == 2 for row in report.decoders.values())
    assert report.decoders["suffix"]["acceptance_length"] > report.decoders["drafter"]["acceptance_length"]
    # one comparison, one baseline: every row's speedup is its tokens/s over the one target-alone row's
    base = report.decoders["target"]["tokens_per_s"]
    for name, row in report.decoders.items():
        assert row["baseline_tokens_per_s"] == base, name
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / base, abs=2e-3), name
    picked = pick_decoder(report.decoders, K)
    assert picked.reason in report.recommendation  # K asked for: drafted with the drafter where nothing won
    assert report.decoder == (picked.decoder if picked.draft else "drafter")
    sources = report.decoders["hybrid"]["by_source"]
    assert sum(s["drafts"] for s in sources.values()) > 0 and sources["suffix"]["accepted_tokens"] > 0
    tags = mlflow_client(demo_adapted.cfg.tracking.tracking_uri).get_registered_model("peagle-drafter").tags
    assert tags["served.decoder"] == report.decoder and tags["served.version"] == "peagle-drafter/2"
    assert tags["served.why"] == report.recommendation and tags["served.k"] == str(K)


def test_the_registry_moves_the_alias_and_tags_the_measurements(demo_adapted):
    client = mlflow_client(demo_adapted.cfg.tracking.tracking_uri)
    version = client.get_model_version_by_alias("peagle-drafter", "serving")
    assert str(version.version) == "2" and version.tags["parent_version"] == "1" and version.tags["promoted"] == "True"
    new = demo_adapted.report.measured["new"].heldout["acceptance_length"]
    assert float(version.tags["adapt/heldout_al"]) == pytest.approx(new)
    metrics = client.get_run(demo_adapted.report.run_id).data.metrics  # the decoders judged, per source too
    hybrid = demo_adapted.report.decoders["hybrid"]
    assert metrics["adapt/decoder_hybrid_speedup"] == pytest.approx(hybrid["speedup"])
    assert metrics["adapt/hybrid_suffix_drafts"] == hybrid["by_source"]["suffix"]["drafts"]


def test_serve_without_a_drafter_serves_the_alias_and_its_recorded_verdict(demo_adapted, tmp_path):
    from peagle_ray.config import with_values
    from peagle_ray.layout import drafter_dir
    from peagle_ray.serve.app import serving_decoder
    from peagle_ray.serve.registry import default_drafter

    report, cfg = demo_adapted.report, demo_adapted.cfg
    chosen = default_drafter(cfg)
    assert chosen.label == "peagle-drafter/2" and str(chosen.directory) == report.served_dir  # served.dir
    assert "registry peagle-drafter: version 2 holds alias 'serving'" in chosen.why
    verdict = chosen.drafter.recommendation
    assert verdict is not None and verdict.reason == f"registry: {report.recommendation}"
    served = serving_decoder(with_values(cfg, {"serving.drafter_version": chosen.label}), chosen.drafter)
    assert served.decoder == report.decoder and served.k == K
    version = mlflow_client(cfg.tracking.tracking_uri).get_model_version("peagle-drafter", "2")
    assert version.tags["export_dir"] == report.export_dir  # where `serve` finds it on this machine
    # no registry (no tracking URI, no local store): the training run's export, saying so
    alone = with_values(cfg, {"tracking.tracking_uri": None, "training.storage_path": str(tmp_path)})
    shutil.copytree(report.export_dir, drafter_dir(alone))
    chosen = default_drafter(alone)
    assert chosen.directory == drafter_dir(alone) and chosen.label is None and chosen.why.endswith("(no registry)")


def test_continuous_mode_skips_a_round_with_nothing_new_and_keeps_serving(demo_loop):
    # continuous mode's round after the adaptation, on the same recording: nothing new, skipped, still serving
    assert demo_loop.skipped is None
    skipped = demo_loop.refusals["no new traffic"]
    assert "skipped this round: too little new traffic" in skipped and "0 requests recorded after" in skipped
    assert "the last adaptation read" in skipped


def test_the_promoted_version_is_swapped_in_with_no_request_dropped(demo_loop):
    report, during = demo_loop.report, demo_loop.during
    assert report.swapped and during.ok > 0 and during.failed == [] and during.mismatched == []
    assert demo_loop.stats["version"] == "peagle-drafter/2" and demo_loop.stats["drafter"] == report.export_dir
    verdict = json.loads((Path(report.export_dir) / "recommendation.json").read_text())  # from held-out timing
    assert verdict["reason"] in report.recommendation and "over 2 timed prompts" in verdict["reason"]
    # K is asked for (adapt_cfg): the endpoint drafts whatever the verdict, with the decoder it names or the drafter
    assert demo_loop.stats["decoder"] == report.decoder == (verdict["decoder"] if verdict["draft"] else "drafter")


def test_the_endpoint_switches_to_the_hybrid_under_load_and_counts_each_source(demo_loop):
    switching, stats = demo_loop.switching, demo_loop.hybrid_stats
    assert switching.ok > 0 and switching.failed == [] and switching.mismatched == []
    assert stats["decoder"] == "hybrid" and stats["threshold"] == 0.5 and stats["algorithm"] == "peagle"
    sources = stats["by_source"]
    assert sources["suffix"]["accepted_tokens"] > 0 and sources["drafter"]["drafts"] > 0  # both sources drafted
    assert sum(s["drafts"] for s in sources.values()) == stats["drafts"]  # vLLM counts every draft once
    assert sum(s["accepted_tokens"] for s in sources.values()) == stats["accepted_tokens"]
    assert f'peagle_source_drafts{{source="suffix"}} {float(sources["suffix"]["drafts"])}' in stats["metrics"]
    assert 'peagle_source_acceptance_rate{position="1",source="drafter"}' in stats["metrics"]


def test_a_drafter_that_cannot_load_leaves_the_served_one_serving(demo_loop):
    failing = demo_loop.failing
    assert f"{demo_loop.report.export_dir} keeps serving" in demo_loop.swap_error
    assert failing.ok > 0 and failing.failed == [] and failing.mismatched == []
    assert demo_loop.after_failure["version"] == "peagle-drafter/2"
    # the replica that served before the failed swap serves after it (put back, not restarted): vLLM's
    # counters went on counting instead of starting again from the few requests a new replica would see
    assert demo_loop.after_failure["drafts"] >= demo_loop.stats["drafts"] > 0


def test_the_registry_verdict_is_read_only_for_the_version_it_judged():
    from peagle_ray.export.speculators import Recommendation
    from peagle_ray.serve.registry import registry_verdict

    tags = {"served.decoder": "suffix", "served.k": "4", "served.version": "peagle-drafter/2", "served.why": "1.7x"}
    assert registry_verdict(tags, "peagle-drafter/2", 3) == Recommendation(True, 4, "registry: 1.7x", "suffix")
    assert registry_verdict(tags, "peagle-drafter/3", 3) is None  # it judged another version
    alone = {**tags, "served.decoder": "target", "served.k": "0"}
    assert registry_verdict(alone, "peagle-drafter/2", 3) == Recommendation(False, 3, "registry: 1.7x")
    assert registry_verdict({}, "peagle-drafter/2", 3) is None
