"""The main job end to end with a tiny budget, on tiny targets of the families users bring (Llama-3.x: llama3
rope, 128,256 rows, untied head; Qwen3: q/k norms, 151,936 rows, tied embeddings, 4 layers; the tiny Llama of
the other tests runs every stage there): the built-in suite's prompts regenerated into data, captured from
the Serve-hosted target, a general P-EAGLE drafter trained in Ray Train and registered, a workload sent
through the recording endpoint, the drafter adapted to it, judged (lossless through stock vLLM), promoted or
not, and the live endpoint serving what the measurement says."""

import json
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from peagle_ray.config import build_config
from peagle_ray.demo import run_demo
from peagle_ray.serve.app import free_port

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_demo_runs_the_whole_loop(family_target, family, tmp_path, capfd):
    tiny_target = family_target(family)
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
            "capture": {"mode": "offline", "output_dir": str(tmp_path / "hidden")},
            "drafter": {"num_depths": 2, "draft_vocab_size": 256},
            "training": {"num_workers": 2, "max_steps": 4, "validate_every": 2, "storage_path": str(tmp_path / "runs")},
            "tracking": {"port": free_port()},
            "serving": {"port": free_port(), "log_dir": str(tmp_path / "logs")},
            "eval": {"suite": "mt-bench", "prompts_per_category": 1, "timing_prompts": 8, "max_new_tokens": 12},
            "adapt": {"max_steps": 2, "min_requests": 2, "validation_fraction": 0.25, "min_gain": 0.0},
            # the first 8 coding prompts: 4 land in the held-out split (a stable hash of their ids)
            "demo": {"workload": "builtin-coding", "requests": 8, "max_tokens": 8},
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
    report = outcome["adapt"]
    assert report["samples"] == {"train": 4, "validation": 4}
    for who in ("parent", "new"):
        heldout = report["measured"][who]["heldout"]
        assert heldout["greedy_mismatches"] == 0 and heldout["timed_prompts"] == 4
        assert len(heldout["acceptance_per_position"]) == 2 and heldout["tokens_per_s"] > 0
    assert f"| general (v{report['parent_version']}) |" in outcome["table"]
    assert f"| adapted (v{report['version']}) |" in outcome["table"] and outcome["table"] in out
    assert set(outcome["minutes"]) == {"target", "data", "general drafter", "workload", "adapt"}
    assert "| Stage | Minutes |" in out and "| total |" in out
    assert json.loads(Path(outcome["json"]).read_text())["adapt"]["version"] == report["version"]

    # the endpoint ends on the adapted drafter when promoted, else on the general one; either drafts only
    # where its held-out measurement was faster than the target alone
    served = Path(report["export_dir"] if report["promote"] else outcome["served"])
    recommendation = json.loads((served / "recommendation.json").read_text())
    assert isinstance(answers[0], str)
    if recommendation["draft"]:
        assert answers[1]["algorithm"] == "peagle" and answers[1]["drafts"] > 0
    else:  # a random tiny drafter is usually slower: the endpoint serves the target alone and says why
        assert answers[1]["algorithm"] is None and answers[1]["drafts"] == 0
        assert "the target alone is served" in out and recommendation["reason"] in out
    recorded = [
        json.loads(line) for f in (Path(cfg.training.storage_path) / "traffic").glob("*.jsonl") for line in f.open()
    ]
    assert len(recorded) >= 9  # the workload and the question asked of the live endpoint: recording stays on

    assert "MLflow UI: http://127.0.0.1:" in out and "curl" in out and outcome["endpoint"] in out
    assert "[demo] logs: " in out and "INFO" not in out + err, (out + err)[-3000:]  # INFO lines go to log files
    client = MlflowClient(f"sqlite:///{Path(cfg.training.storage_path) / 'mlflow' / 'mlflow.db'}")
    versions = client.search_model_versions(f"name = '{cfg.tracking.registered_model}'")
    assert {str(v.version) for v in versions} == {report["parent_version"], report["version"]}
    runs = {r.info.run_name: r for r in client.search_runs(client.search_experiments()[0].experiment_id)}
    assert "peagle" in runs and client.get_metric_history(runs["peagle"].info.run_id, "train/loss")
