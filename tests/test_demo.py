"""The main job end to end on the tiny target with a tiny budget: data from the built-in suite with
regenerated responses, P-EAGLE and EAGLE-3 trained on streamed capture, evaluation, the live endpoint."""

import json
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from peagle_ray.config import build_config
from peagle_ray.demo import run_demo
from peagle_ray.serve.app import free_port

pytestmark = pytest.mark.vllm


def test_demo_runs_the_whole_chain(tiny_target, tmp_path, capfd):
    cfg = build_config(
        {
            "target": {"path": str(tiny_target), "max_model_len": 512, "kv_cache_gib": 1},
            "data": {
                "sources": ["builtin"],
                "max_length": 160,
                "regenerate": True,
                "max_new_tokens": 16,
                "output_dir": str(tmp_path / "data"),
            },
            "capture": {"mode": "online"},
            "drafter": {"num_depths": 2, "draft_vocab_size": 256},
            "training": {"num_workers": 2, "max_steps": 4, "validate_every": 2, "storage_path": str(tmp_path / "runs")},
            "tracking": {"port": free_port()},
            "serving": {"port": free_port(), "log_dir": str(tmp_path / "logs")},
            "eval": {"k_values": [2], "prompts_per_category": 1, "timing_prompts": 1, "max_new_tokens": 12},
        }
    )
    answers = []

    def ask(url):
        body = {"model": tiny_target.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            answers.append(json.loads(resp.read())["choices"][0]["message"]["content"])
        with urllib.request.urlopen(f"{url}/v1/speculative_stats", timeout=30) as resp:
            answers.append(json.loads(resp.read()))

    outcome = run_demo(cfg, wait=False, on_ready=ask)
    out, err = capfd.readouterr()  # the file descriptors: what a person at the console sees, from any process
    (tmp_path / "console.txt").write_text(out + err)
    results = outcome["eval"]
    for algorithm in ("peagle", "eagle3"):
        overall = results[algorithm]["by_k"][2]["overall"]
        assert set(overall) >= {
            "k",
            "acceptance_per_position",
            "acceptance_length",
            "tokens_per_s",
            "baseline_tokens_per_s",
            "speedup",
            "greedy_mismatches",
        }
        assert overall["greedy_mismatches"] == 0 and overall["tokens_per_s"] > 0
        assert len(overall["acceptance_per_position"]) == 2 and results[algorithm]["recommended_k"] in (0, 2)
        assert set(results[algorithm]["by_k"][2]) == {*results["categories"], "overall"}
    assert results["greedy_mismatches"] == 0 and "speedup_vs_eagle3" in results["peagle"]["best"]["overall"]
    assert isinstance(answers[0], str)
    if results["peagle"]["recommended_k"]:  # measured faster than the target alone: served with its drafter
        assert answers[1]["algorithm"] == "peagle" and answers[1]["drafts"] > 0 and "drafter:  peagle at K = 2" in out
    else:  # a random tiny drafter is usually slower: the endpoint serves the target alone and says why
        assert answers[1]["algorithm"] is None and answers[1]["drafts"] == 0
        assert "the target alone is served" in out and results["peagle"]["recommendation"] in out
    assert "| Category | Pos 1 | Pos 2 | Avg Length |" in out and "MLflow UI: http://127.0.0.1:" in out
    assert "curl" in out and outcome["endpoint"] in out
    assert "[demo] logs: " in out and "INFO" not in out + err, (out + err)[-3000:]  # INFO lines go to log files
    client = MlflowClient(f"sqlite:///{Path(cfg.training.storage_path) / 'mlflow' / 'mlflow.db'}")
    runs = {r.info.run_name: r for r in client.search_runs(client.search_experiments()[0].experiment_id)}
    assert {"peagle", "peagle-eagle3"} <= set(runs)
    for run in runs.values():
        assert client.get_metric_history(run.info.run_id, "eval/acceptance_length")[0].step == 2
        assert client.get_metric_history(run.info.run_id, "train/loss")
