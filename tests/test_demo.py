"""The main job end to end with a tiny budget, run once per session on a tiny target of a family users bring
(Llama-3.x: llama3 rope, 128,256 rows, untied head; tests/helpers/demo_loop.py, conftest's `demo_loop`) and
checked part by part: the built-in suite's prompts regenerated into data, captured from the Serve-hosted
target, a general P-EAGLE drafter trained in Ray Train and registered, a workload sent through the recording
endpoint, the drafter adapted to it, judged (lossless through stock vLLM), promoted or not, and the live
endpoint serving what the measurement says. The same run's adaptation is checked part by part in
test_adapt.py. (Qwen3's and GPT-OSS's rope and shapes run through capture and vLLM serving in
test_capture.py and test_export.py.)"""

import json
from pathlib import Path

import pytest

from tests.helpers.demo_workload import DEMO_REQUESTS, REPEATS, WORKLOAD, K
from tests.helpers.mlflow_store import mlflow_client

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]  # a stage of the demo's run can be a test's setup


def test_the_adaptation_judges_both_drafters_losslessly_on_the_heldout_requests(demo_adapted):
    report = demo_adapted.outcome.adapt
    # the demo's workload and the narrow one sent at the adapt stage, split by conversation id
    assert sum(report.samples.values()) == DEMO_REQUESTS + len(WORKLOAD) * REPEATS
    for judged in report.measured.values():
        heldout = judged.heldout
        assert heldout["greedy_mismatches"] == 0 and heldout["timed_prompts"] == 2
        assert len(heldout["acceptance_per_position"]) == K and heldout["tokens_per_s"] > 0
    saved = json.loads(demo_adapted.outcome.json.read_text())["adapt"]
    assert saved["version"] == report.version and saved["measured"]["new"]["heldout"] == report.measured["new"].heldout


def test_the_console_shows_the_table_the_stages_and_the_endpoint(demo_adapted):
    outcome, out, report = demo_adapted.outcome, demo_adapted.console, demo_adapted.outcome.adapt
    assert f"| general (v{report.parent_version}) |" in outcome.table
    assert f"| adapted (v{report.version}) |" in outcome.table and outcome.table in out
    assert set(outcome.minutes) == {"target", "data", "general drafter", "workload", "adapt"}
    assert "| Stage | Minutes |" in out and "| total |" in out
    assert "MLflow UI: http://127.0.0.1:" in out and "curl" in out and outcome.endpoint in out
    assert "[demo] logs: " in out and "INFO" not in out, out[-3000:]  # INFO lines go to log files


def test_the_endpoint_serves_the_decoder_its_heldout_measurement_chose(demo_loop):
    outcome, answers, report = demo_loop.outcome, demo_loop.answers, demo_loop.outcome.adapt
    # adapt timed suffix decoding and the hybrid beside the served drafter and the target alone; the endpoint
    # ends on its choice (the fastest measurably faster decoder, else the target alone), or - where that is
    # what it served already - stays as it was
    assert set(report.decoders) == {"target", "drafter", "suffix", "hybrid"}
    assert "| suffix decoding |" in outcome.table and "| hybrid (" in outcome.table
    assert f"served: {report.recommendation}" in outcome.table
    assert isinstance(answers[0], str)
    served = answers[1]
    assert served["decoder"] == (report.decoder if report.swapped else "drafter"), (served, report.recommendation)
    if served["decoder"] in ("drafter", "hybrid"):  # the drafter drafts every step; suffix decoding where it matches
        assert served["drafts"] > 0
    elif served["decoder"] == "target":
        assert served["drafts"] == 0
    assert json.loads(outcome.json.read_text())["served"] == served_description(served)
    assert "decoder:  " in demo_loop.console and served["why"] in demo_loop.console
    tags = mlflow_client(f"sqlite:///{Path(demo_loop.cfg.training.storage_path) / 'mlflow' / 'mlflow.db'}")
    model = tags.get_registered_model(demo_loop.cfg.tracking.registered_model).tags
    assert model["served.decoder"] == served["decoder"] and model["served.version"] == served["version"]


def served_description(stats: dict) -> dict:
    """The part of /v1/speculative_stats that says what is served (serve/decoder.ServedDecoder.to_json)."""
    return {key: stats[key] for key in ("decoder", "k", "algorithm", "drafter", "version", "threshold", "why")}


def test_recording_stays_on_for_the_live_endpoint(demo_loop):
    storage = Path(demo_loop.cfg.training.storage_path)
    recorded = [json.loads(line) for f in (storage / "traffic").glob("*.jsonl") for line in f.open()]
    assert len(recorded) >= 9  # the workload and the question asked of the live endpoint


def test_mlflow_holds_both_versions_and_the_training_curve(demo_adapted):
    storage, report = Path(demo_adapted.cfg.training.storage_path), demo_adapted.outcome.adapt
    client = mlflow_client(f"sqlite:///{storage / 'mlflow' / 'mlflow.db'}")
    versions = client.search_model_versions(f"name = '{demo_adapted.cfg.tracking.registered_model}'")
    assert {str(v.version) for v in versions} == {report.parent_version, report.version}
    runs = {r.info.run_name: r for r in client.search_runs(client.search_experiments()[0].experiment_id)}
    assert "peagle" in runs and client.get_metric_history(runs["peagle"].info.run_id, "train/loss")


def test_the_results_table_takes_every_speedup_from_one_comparison():
    from peagle_ray.adapt import AdaptReport, Judged, Verdict
    from peagle_ray.demo import results_table

    def row(al, tps, base, se=0.05):
        return {
            "acceptance_length": al,
            "acceptance_per_position": [al - 1, 0.0],
            "tokens_per_s": tps,
            "baseline_tokens_per_s": base,
            "speedup": round(tps / base, 3),
            "speedup_se": se,
            "greedy_mismatches": 0,
        }

    judged = {  # judge's session: its own baseline (15.7 tok/s), not the decoders'
        "parent": Judged(row(1.23, 17.9, 15.7), {"acceptance_length": 1.21}),
        "new": Judged(row(1.30, 18.5, 15.7), {"acceptance_length": 1.16}),
    }
    session = {  # the decoder comparison: one target-alone engine at 16.9 tok/s
        "target": row(1.0, 16.9, 16.9, None),
        "drafter": row(1.30, 19.6, 16.9),
        "suffix": row(2.20, 29.1, 16.9),
        "hybrid": row(2.12, 26.5, 16.9),
    }
    report = AdaptReport(
        "peagle-drafter", "1", "2", 4, {"validation": 10}, 80, judged, Verdict(0.07, 0.05, True, "ok"),
        "suffix", "suffix is served", "/x", "run", decoders=session,
    )  # fmt: skip
    lines = results_table(report).splitlines()
    target = next(x for x in lines if x.startswith("| target alone |"))
    assert "| 16.9 | 1.00x |" in target
    assert next(x for x in lines if x.startswith("| adapted (v2) |")).count("| 19.6 | 1.16x +- 0.05 |") == 1
    assert "| - | - (AL judged only) |" in next(x for x in lines if x.startswith("| general (v1) |"))
    suffix = next(x for x in lines if x.startswith("| suffix decoding |"))
    assert "| 29.1 | 1.72x +- 0.05 |" in suffix and round(29.1 / 16.9, 2) == 1.72  # speedup = its tok/s ratio
