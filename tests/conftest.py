"""Session-wide fixtures (the tiny random target is built once per test session) and the test tiers.

Tiers (markers, registered in pyproject.toml): `ray` (a local Ray cluster: any test using `ray_local` gets it),
`vllm` (starts a vLLM engine: any test using one of ENGINE_FIXTURES gets it), `slow` (over a few seconds without either), `gpu` (needs CUDA; skipped without
it). Every test with none of these is `unit`: `pytest -m unit` runs them all in well under a minute, and
`make test` (CI) runs every tier. The unit tier is enforced, not trusted: a unit test that starts a subprocess
or a Ray cluster, or imports vLLM's engine, fails and names the marker it needs (`_unit_tier_guard`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest


def share_the_cores_between_workers(environ=os.environ) -> int | None:
    """Under pytest-xdist, each worker's share of the cores as the OpenMP threads of everything it starts
    (its own torch, every vLLM engine's model, the commands it runs): two engines of two threads each on two
    cores decoded 2.5x slower than alone (113 against 288 tokens/s, each with one thread), their barriers
    waiting on each other's threads. Measured on this 2-core box, tests/test_export.py beside tests/test_eval.py
    (-n 2): 211 and 226 s with every engine on both cores, 164 s with one thread each. Set before torch is
    imported here; VLLM_CPU_NUM_OF_RESERVED_CPU reaches the engines that Ray Serve hosts (engine.py: the
    environment's value wins over target.cpu_reserved_cores). Returns the threads (None outside xdist)."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers < 2:
        return None
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // workers)
    environ.setdefault("OMP_NUM_THREADS", str(threads))
    environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cores - threads))
    return threads


share_the_cores_between_workers()

from tests.helpers.tiny_target import build_tiny_target  # noqa: E402 - torch is imported after the threads are set

REPO = Path(__file__).resolve().parents[1]
HEAVY_TIERS = ("ray", "vllm", "slow", "gpu")
# fixtures that start a vLLM engine (a Serve-hosted target or endpoint, a capture, a job that captures): a test
# using one is in the vllm tier, so that `-m "not vllm"` starts no engine
ENGINE_FIXTURES = {
    "demo_recorded": "conftest: the demo's run, to its adapt stage",
    "demo_adapted": "conftest: the demo's run, adapted",
    "demo_loop": "conftest: the demo's run with the adaptation loop's live checks",
    "session": "test_capture.py: the Serve-hosted target",
    "endpoint": "test_serve.py: the endpoint",
    "deploy": "test_serve_load.py: the endpoint, per decoder",
    "captured_data": "conftest: prepared and captured tiny data",
    "captured": "test_multinode.py: the capture job",
}


# pytest-xdist (`make test` runs two workers, `-n 2 --dist loadgroup`): each file's tests run in one worker, so
# that its module fixtures are built once, and the files sharing a session scenario (the adaptation loop, the
# captured training data) run in the worker that built it. Each worker has its own local Ray cluster
# (ray_local); every Serve endpoint, MLflow server and multi-node cluster takes a free port.
SHARED_SCENARIOS = {
    "test_adapt.py": "test_demo.py",  # the demo's run (demo_loop)
    "test_bench_adapt.py": "test_demo.py",
    "test_bench_learning.py": "test_train_job.py",  # the captured training data (captured_data)
}


# Seconds each group took in a two-worker run (a clean-clone run of 2026-12-07 with --durations=0, rounded; the
# demo's group before its broken swap lost two retries and a restart, ~1420 s then; multinode, bench and target
# re-estimated after bench capture moved to test_bench.py, the two-node training job joined the node-loss test,
# SmolLM2 was converted once and test_plan's peaks took one step): the groups are handed out longest first
# (`--no-loadscope-reorder` keeps this order), so that the two workers end together instead of one starting the
# longest group late. Only the order matters; a group not listed goes last.
GROUP_SECONDS = {
    "test_demo.py": 1100,  # with test_adapt.py and test_bench_adapt.py (demo_loop)
    "test_multinode.py": 780,
    "test_train_job.py": 720,  # with test_bench_learning.py (captured_data)
    "test_serve_load.py": 465,
    "test_shutdown.py": 395,
    "test_export.py": 330,
    "test_bench.py": 260,
    "test_eval.py": 230,
    "test_capture.py": 130,
    "test_serve.py": 115,
    "test_target_families.py": 110,
    "test_target.py": 100,
    "test_gpu_check.py": 80,
    "test_plan.py": 75,
    "test_cli.py": 50,
}


def group_of(item) -> str:
    module = Path(str(item.fspath)).name
    return SHARED_SCENARIOS.get(module, module)


def pytest_itemcollected(item) -> None:
    """Each test's xdist group, set as it is collected (xdist reads the groups in its collection hook)."""
    item.add_marker(pytest.mark.xdist_group(group_of(item)))


def pytest_collection_modifyitems(config, items) -> None:
    import torch

    items.sort(key=lambda item: -GROUP_SECONDS.get(group_of(item), 0))  # stable: files keep their own order

    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "ray_local" in fixtures:
            item.add_marker(pytest.mark.ray)
        if fixtures & ENGINE_FIXTURES.keys():
            item.add_marker(pytest.mark.vllm)
        if not any(item.get_closest_marker(tier) for tier in HEAVY_TIERS):
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (scripts/gpu_check.sh runs these)"))


class TierError(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _unit_tier_guard(request, monkeypatch):
    """Unit tests stay unit: starting a subprocess other than git (the `slow` tier), a Ray cluster (`ray`) or
    importing vLLM's offline engine (`vllm`) fails the test with the marker to add, instead of slowing
    `make unit` unnoticed."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(what: str, marker: str):
        def call(*args, **kwargs):
            raise TierError(f"a unit test {what}: mark it @pytest.mark.{marker} (tests/conftest.py)")

        return call

    popen, refused = subprocess.Popen.__init__, refuse("started a subprocess", "slow")

    def start(self, cmd, *args, **kwargs):  # git (provenance's commit, milliseconds) and fc-list (matplotlib's
        # font cache, built once per machine by whichever test draws first) are allowed, and so are background
        # threads left by earlier tests of other tiers (the test itself runs in the main thread)
        first = cmd if isinstance(cmd, str) else cmd[0]
        allowed = Path(str(first).split()[0]).name in ("git", "fc-list")
        allowed = allowed or threading.current_thread() is not threading.main_thread()
        return (popen if allowed else refused)(self, cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", start)
    ray = sys.modules.get("ray")
    if ray is not None:  # imported by the code under test: any cluster start goes through ray.init
        monkeypatch.setattr(ray, "init", refuse("started a Ray cluster", "ray"))
    ray_before = ray is not None and ray.is_initialized()  # a session cluster of an earlier ray-tier test
    engine_before = "vllm.entrypoints.llm" in sys.modules
    yield
    ray = sys.modules.get("ray")
    if not ray_before and ray is not None and ray.is_initialized():  # imported and started inside the test
        ray.shutdown()
        raise TierError("a unit test started a Ray cluster: mark it @pytest.mark.ray (tests/conftest.py)")
    if not engine_before and "vllm.entrypoints.llm" in sys.modules:
        raise TierError("a unit test imported vLLM's offline engine: mark it @pytest.mark.vllm (tests/conftest.py)")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """HF directory of a random 6-layer Llama (hidden 96, vocab 516) with a locally trained tokenizer."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def family_target(tmp_path_factory):
    """build(name) -> HF directory of tiny_target.FAMILIES[name] (llama3, qwen3, gpt-oss-rope), built once per
    session: the real families' architectures, vocabulary sizes, ropes and head tying at a tiny width."""
    from tests.helpers.tiny_target import FAMILIES

    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_target(tmp_path_factory.mktemp(f"{name}-target"), FAMILIES[name])
        return built[name]

    return build


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray cluster for the integration tests (started once, shut down at the end)."""
    import ray

    from peagle_ray.cluster import set_local_cluster_env

    set_local_cluster_env()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    from ray import serve

    # Replicas stop gracefully first (their vLLM engine processes would outlive a killed actor): deleting the
    # applications does that. serve.shutdown() then shuts the driver's cached deployment handles down, and once
    # (a clean-clone rehearsal, 2026-12-07) one of those never returned (ServeControllerClient.
    # shutdown_cached_handles waiting on a router's future); it gets two minutes before Ray is stopped anyway.
    for name in serve.status().applications:
        serve.delete(name)
    stopper = threading.Thread(target=serve.shutdown, name="serve-shutdown", daemon=True)
    stopper.start()
    stopper.join(timeout=120)
    if stopper.is_alive():
        print(
            "ray_local: serve.shutdown() did not return in 120 s (a cached handle's shutdown); stopping Ray",
            file=sys.stderr,
        )
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_recorded(family_target, tmp_path_factory, request):
    """The demo run once on the tiny Llama-3 target (tests/helpers/demo_loop.py DemoLoop), here as far as its
    adapt stage: the general drafter served, the workload recorded, adapt's refusals checked. demo_adapted and
    demo_loop run it on: each stage's setup counts against the first test that needs it, not the whole run
    against one."""
    from transformers import AutoTokenizer

    from tests.helpers.demo_loop import DemoLoop
    from tests.helpers.demo_workload import TOKENS, WORKLOAD
    from tests.test_serve import hf_greedy

    target = family_target("llama3")
    tokenizer = AutoTokenizer.from_pretrained(target)
    expected = {p: hf_greedy(target, tokenizer(p)["input_ids"], TOKENS) for p in WORKLOAD}
    capture = request.config.pluginmanager.getplugin("capturemanager")
    run = DemoLoop(target, tmp_path_factory.mktemp("demo-loop"), expected, capture)
    request.addfinalizer(run.close)  # a stage that failed, or a session that ends early, stops it all
    run.advance("adapt")
    return run


@pytest.fixture(scope="session")
def demo_adapted(demo_recorded):
    """The demo run on to its end (adapt: judged, promoted, swapped; the results printed): the endpoint live."""
    demo_recorded.advance("ready")
    return demo_recorded


@pytest.fixture(scope="session")
def demo_loop(demo_adapted):
    """The demo done: the live checks on its endpoint (a chat, a drafter that cannot load, continuous mode's
    round with nothing new, the switch to the hybrid under load), then everything stopped."""
    demo_adapted.finish()
    return demo_adapted


@pytest.fixture(scope="session")
def captured_data(tiny_target, ray_local, tmp_path_factory):
    """tests/helpers/train_data.py's prompts prepared and captured (offline shards) once, through the
    Serve-hosted tiny target: the directory the config of train_data.config(dir, tiny_target) reads."""
    from peagle_ray.capture.run import prepare_and_capture
    from tests.helpers.train_data import PROMPTS, config

    tmp = tmp_path_factory.mktemp("train")
    (tmp / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    prepare_and_capture(config(tmp, tiny_target), prepare=True, capture=True)
    return tmp
