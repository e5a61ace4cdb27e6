"""The jobs across Ray nodes: a two-node cluster on loopback (tests/helpers/cluster.py), jobs submitted with
`ray job submit` under token auth, placement read back from Ray's state API, node loss and elastic training.
"""

from __future__ import annotations

import itertools
import subprocess
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

from peagle_ray.config import build_config, dump_config
from peagle_ray.tracking import RUN_NAME_TAG, metric_history
from tests.helpers.cluster import BIN, LoopbackCluster
from tests.helpers.mlflow_store import mlflow_client
from tests.helpers.train_data import PROMPTS as TRAIN_JOB_PROMPTS, raw_config

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
PROMPTS = TRAIN_JOB_PROMPTS[:8]
TRAIN_CMD = ("python", "jobs/train.py", "--config")  # deploy/kuberay/rayjob-train.yaml runs the same


def config(tmp: Path, tiny_target: Path, run_name: str, **training) -> dict:
    """tests/helpers/train_data.py's run, spread: capture replicas one per node, workers SPREAD."""
    training = {
        "placement_strategy": "SPREAD",
        "max_steps": 6,
        "validate_every": 3,
        "validation_records": 2,
        **training,
    }
    raw = raw_config(tmp, tiny_target, run_name=run_name, **training)
    raw["data"]["validation_fraction"] = 0.25
    raw["capture"].update(batch_size=4, num_actors=2, num_replicas=2, max_replicas_per_node=1)
    raw["tracking"]["registered_model"] = None
    return raw


def write_config(tmp: Path, name: str, raw: dict) -> Path:
    path = tmp / f"{name}.yaml"
    dump_config(build_config(raw), path)
    return path


def ran_on(actors: list[dict], class_name: str) -> list[str]:
    return [a["node_id"] for a in actors if class_name in a["class_name"]]


def named(cluster, node_ids: list[str]) -> Counter:
    """Node ids -> how many actors ran on each node, by node name (for the printed placement)."""
    names = {n.node_id: n.name for n in cluster.nodes.values()}
    return Counter(names.get(i, str(i)) for i in node_ids)


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
    return tmp, cluster.actors()


def test_capture_job_spreads_target_replicas_over_both_nodes(cluster, captured):
    tmp, actors = captured
    replicas = ran_on(actors, "TargetServer")
    stages = ran_on(actors, "CaptureStage")
    print("capture: target replicas ran on", named(cluster, replicas), "capture actors on", named(cluster, stages))
    assert len(replicas) == 2 and set(replicas) == {n.node_id for n in cluster.nodes.values()}
    assert len(stages) == 2
    assert (tmp / "hidden" / "manifest.json").is_file()


def test_the_cluster_refuses_a_client_without_its_token(cluster):
    wrong = {**cluster.env, "RAY_AUTH_TOKEN": "0" * 32}
    out = subprocess.run([str(BIN / "ray"), "job", "list", f"--address={cluster.dashboard}"], env=wrong,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0 and "auth" in (out.stdout + out.stderr).lower()
    assert cluster.run("ray", "job", "list", f"--address={cluster.dashboard}").returncode == 0


def test_a_storage_path_some_node_cannot_see_is_refused_naming_the_field(cluster, captured, tiny_target):
    tmp, _ = captured
    hidden = tmp / "not-shared"
    hidden.mkdir()
    node = cluster.add_node("node3", hidden=hidden)
    try:
        cluster.wait_alive(3)
        raw = config(tmp, tiny_target, "unshared", storage_path=str(hidden))
        out = cluster.submit(REPO, *TRAIN_CMD, str(write_config(tmp, "unshared", raw)), check=False)
    finally:
        cluster.remove_node("node3")
        cluster.wait_alive(2)
    assert out.returncode != 0
    assert f"training.storage_path = {hidden} is a local path that node(s) {node.node_id[:12]} (" in out.stdout
    assert not (hidden / "unshared").exists()  # refused before any worker started


def metric(tmp: Path, run_name: str, name: str) -> list[tuple[int, float]]:
    """(step, value) of a run's metric, read from the tracking store while the job runs ([] before)."""
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = mlflow_client(uri)
    experiment = client.get_experiment_by_name("peagle-ray")
    runs = client.search_runs([experiment.experiment_id], f"tags.`{RUN_NAME_TAG}` = '{run_name}'") if experiment else []
    return metric_history(uri, runs[0].info.run_id, name) if runs else []


def wait_for(condition, what: str, job, timeout: float = 300, every: float = 1.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        if job.poll() is not None:
            raise AssertionError(f"the job ended ({job.returncode}) while waiting for {what}")
        time.sleep(every)
    raise TimeoutError(f"waited {timeout} s for {what}")


@contextmanager
def training_job(cluster, tmp: Path, raw: dict, env_vars: dict | None = None):
    """A training job submitted in the background; the block drives the cluster meanwhile. On leaving, the
    job must have succeeded (it is killed if the block raised)."""
    path = write_config(tmp, raw["training"]["run_name"], raw)
    job = cluster.submit_background(REPO, *TRAIN_CMD, str(path), env_vars=env_vars)
    try:
        yield job
        assert job.wait(timeout=600) == 0
    finally:
        job.kill()


def lose_node_mid_training(cluster, tmp, run_name, job, after_step):
    """Kill node2's raylet once MLflow has steps past `after_step` (a checkpoint is behind them); returns the
    step reached and the kill time."""
    reached = wait_for(lambda: max((s for s, _ in metric(tmp, run_name, "train/loss")), default=-1) >= after_step and
                       max(s for s, _ in metric(tmp, run_name, "train/loss")), f"step {after_step}", job)  # fmt: skip
    killed = cluster.kill_node("node2")
    cluster.wait_alive(1)
    return reached, killed


def test_training_spreads_over_both_nodes_matches_one_node_and_resumes_after_losing_a_node(
    cluster, captured, tiny_target, ray_local
):
    """A fixed-size group of two workers SPREAD over the two nodes; node2 is killed past step 10: the survivor
    waits, the group restarts from the checkpoint once the node is back, and MLflow has every step once. The
    steps logged before the kill, by workers on both nodes, equal those of the same run on one node (this
    process's own cluster)."""
    from peagle_ray.train.job import run_training

    tmp, _ = captured
    steps = 60
    raw = config(tmp, tiny_target, "node-loss", max_steps=steps, validate_every=10, max_failures=3)
    before = {a["actor_id"] for a in cluster.actors()}
    node2 = cluster.nodes["node2"].node_id  # it comes back under a new id
    started = time.time()
    with training_job(cluster, tmp, raw) as job:
        reached, killed = lose_node_mid_training(cluster, tmp, "node-loss", job, 10)
        time.sleep(5)  # the survivor waits: a fixed-size group needs both workers
        stalled = max(s for s, _ in metric(tmp, "node-loss", "train/loss"))
        cluster.restart_node("node2")
        resumed = wait_for(lambda: max(s for s, _ in metric(tmp, "node-loss", "train/loss")) > stalled and time.time(),
                           "training to resume", job)  # fmt: skip
    wall = time.time() - started
    history = metric(tmp, "node-loss", "train/loss")
    print(f"node-loss: killed at logged step {reached}, resumed {resumed - killed:.0f} s after the kill, "
          f"{len(history)} steps in MLflow, job wall time {wall:.0f} s")  # fmt: skip
    assert [s for s, _ in history] == list(range(steps))  # every step exactly once
    assert {v for _, v in metric(tmp, "node-loss", "train/workers")} == {2}
    workers = ran_on([a for a in cluster.actors() if a["actor_id"] not in before], "RayTrainWorker")
    print("training workers ran on", named(cluster, workers), "and one on node2 before the kill", node2 in workers)
    assert len(workers) == 4  # the group was started twice, two workers each time
    # the first group's two workers: one on node2 (the second group started after node2 was lost), so the other
    # on the head, the only other node then
    assert workers.count(node2) == 1

    run_training(build_config({**raw, "training": {**raw["training"], "run_name": "one-node"}}))
    one_node = metric(tmp, "one-node", "train/loss")
    assert [s for s, _ in one_node] == list(range(steps))
    assert [v for _, v in history[: reached + 1]] == pytest.approx([v for _, v in one_node[: reached + 1]], rel=1e-5)
    after = [
        abs(a - b) / abs(b) for (_, a), (_, b) in zip(history[reached + 1 :], one_node[reached + 1 :], strict=True)
    ]
    print(
        f"node-loss: steps 0-{reached} equal one node's; after the resume at most {max(after, default=0.0):.2e} apart"
    )


def test_elastic_training_shrinks_to_one_worker_and_grows_back(cluster, captured, tiny_target):
    tmp, _ = captured
    # long enough to outlast the shrink, the node's return and the regrowth below: the one-worker stretch
    # took 40 and 90 steps in two runs alone (2026-12-07; 200 steps would leave it < 2x that room)
    steps = 300
    raw = config(tmp, tiny_target, "elastic", max_steps=steps, validate_every=10, max_failures=3,
                 num_workers=[1, 2], resize_check_s=2, epochs=1000)  # fmt: skip
    # Ray Train first retries with the workers its cluster view (refreshed every 20 s) still counts, and waits
    # this long for them before it settles for fewer (default 60 s; README: elastic training).
    fast = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15"}
    started = time.time()
    with training_job(cluster, tmp, raw, env_vars=fast) as job:
        reached, killed = lose_node_mid_training(cluster, tmp, "elastic", job, 10)
        one = wait_for(lambda: 1 in {v for _, v in metric(tmp, "elastic", "train/workers")} and time.time(),
                       "steps on one worker", job)  # fmt: skip
        cluster.restart_node("node2")
        cluster.wait_alive(2)
        back = time.time()
        two = wait_for(lambda: [v for _, v in metric(tmp, "elastic", "train/workers")][-1:] == [2] and
                       any(v == 1 for _, v in metric(tmp, "elastic", "train/workers")) and time.time(),
                       "the second worker back", job)  # fmt: skip
    wall = time.time() - started
    history = metric(tmp, "elastic", "train/loss")
    workers = [int(v) for _, v in metric(tmp, "elastic", "train/workers")]
    runs = [(w, sum(1 for _ in g)) for w, g in itertools.groupby(workers)]
    print(f"elastic: killed at logged step {reached}; training went on with one worker {one - killed:.0f} s "
          f"after the kill; two workers again {two - back:.0f} s after the node returned; world sizes by "
          f"step {runs}; job wall time {wall:.0f} s")  # fmt: skip
    assert [s for s, _ in history] == list(range(steps))
    assert [w for w, _ in runs] == [2, 1, 2]
