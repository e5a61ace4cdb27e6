"""The jobs across Ray nodes: a two-node cluster on loopback (tests/helpers/cluster.py), jobs submitted with
`ray job submit` under token auth, placement read back from Ray's state API, node loss and elastic training.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from peagle_ray.config import build_config, dump_config
from tests.helpers.cluster import LoopbackCluster

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a haiku about rain.",
    "What is a socket?",
    "Sort a list in Python.",
    "Name three colors.",
    "Explain recursion briefly.",
    "Translate 'good morning' into French.",
    "What is 12 times 7?",
    "Describe a cat in one sentence.",
]
TRAIN_CMD = ("python", "jobs/train.py", "--config")  # deploy/kuberay/rayjob-train.yaml runs the same


def config(tmp: Path, tiny_target: Path, run_name: str, **training) -> dict:
    return {
        "target": {"path": str(tiny_target), "max_model_len": 256, "kv_cache_gib": 1},
        "data": {
            "sources": [str(tmp / "prompts.txt")],
            "max_new_tokens": 24,
            "output_dir": str(tmp / "data"),
            "validation_fraction": 0.25,
        },
        "capture": {
            "mode": "offline",
            "output_dir": str(tmp / "hidden"),
            "batch_size": 4,
            "num_actors": 2,
            "num_replicas": 2,
            "max_replicas_per_node": 1,
        },
        "drafter": {"num_depths": 3, "draft_vocab_size": 300},
        "training": {
            "num_workers": 2,
            "placement_strategy": "SPREAD",
            "max_steps": 6,
            "validate_every": 3,
            "validation_records": 2,
            "sequences_per_step": 1,
            "segment_length": 64,
            "storage_path": str(tmp / "train"),
            "epochs": 50,
            "run_name": run_name,
            **training,
        },
        "tracking": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "registered_model": None},
    }


def write_config(tmp: Path, name: str, raw: dict) -> Path:
    path = tmp / f"{name}.yaml"
    dump_config(build_config(raw), path)
    return path


def ran_on(actors: list[dict], class_name: str, job_id: str | None = None) -> list[str]:
    return [a["node_id"] for a in actors if class_name in a["class_name"] and job_id in (None, a.get("job_id"))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LoopbackCluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start_head()
        c.add_node("node2")
        c.wait_alive(2)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def captured(cluster, tiny_target, tmp_path_factory):
    """Prepare + capture submitted to the two-node cluster: two target replicas, one per node."""
    tmp = tmp_path_factory.mktemp("multinode")
    (tmp / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = write_config(tmp, "capture", config(tmp, tiny_target, "unused"))
    out = cluster.submit(REPO, "python", "jobs/capture.py", "--config", str(cfg))
    assert "succeeded" in out.stdout, out.stdout[-3000:]
    return tmp, out


def test_capture_job_spreads_target_replicas_over_both_nodes(cluster, captured):
    tmp, out = captured
    actors = cluster.actors()
    replicas = ran_on(actors, "TargetServer")
    stages = ran_on(actors, "CaptureStage")
    print("target replicas ran on", replicas, "capture actors on", stages)
    assert len(replicas) == 2 and set(replicas) == {n.node_id for n in cluster.nodes.values()}
    assert len(stages) == 2
    assert (tmp / "hidden" / "manifest.json").is_file()


def test_training_spreads_over_both_nodes_and_matches_one_node(cluster, captured, tiny_target, ray_local):
    from peagle_ray.train.job import run_training

    tmp, _ = captured
    raw = config(tmp, tiny_target, "two-nodes")
    out = cluster.submit(REPO, *TRAIN_CMD, str(write_config(tmp, "two-nodes", raw)))
    assert "succeeded" in out.stdout, out.stdout[-3000:]
    workers = ran_on(cluster.actors(), "RayTrainWorker")
    print("training workers ran on", Counter(workers))
    assert set(workers) == {n.node_id for n in cluster.nodes.values()}

    one_node = run_training(build_config(config(tmp, tiny_target, "one-node")))
    client = MlflowClient(one_node["tracking_uri"])
    runs = {
        r.info.run_name: r.info.run_id
        for r in client.search_runs(client.get_experiment_by_name("peagle-ray").experiment_id)
    }
    losses = {
        name: [(m.step, m.value) for m in client.get_metric_history(runs[name], "train/loss")]
        for name in ("two-nodes", "one-node")
    }
    assert [s for s, _ in losses["two-nodes"]] == [s for s, _ in losses["one-node"]] == list(range(6))
    assert [v for _, v in losses["two-nodes"]] == pytest.approx([v for _, v in losses["one-node"]], rel=1e-5)
