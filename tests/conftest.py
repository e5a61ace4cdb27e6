"""Session-wide fixtures (the tiny random target is built once per test session) and the test tiers.

Tiers (markers, registered in pyproject.toml): `ray` (a local Ray cluster: any test using `ray_local` gets it),
`vllm` (starts a vLLM engine), `slow` (over a few seconds without either), `gpu` (needs CUDA; skipped without
it). Every test with none of these is `unit`: `pytest -m unit` runs them all in well under a minute, and
`make test` (CI) runs every tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_ray.tiny_target import build_tiny_target

REPO = Path(__file__).resolve().parents[1]
HEAVY_TIERS = ("ray", "vllm", "slow", "gpu")


def pytest_collection_modifyitems(config, items) -> None:
    import torch

    for item in items:
        if "ray_local" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
        if not any(item.get_closest_marker(tier) for tier in HEAVY_TIERS):
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (scripts/gpu_check.sh runs these)"))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """HF directory of a random 6-layer Llama (hidden 96, vocab 516) with a locally trained tokenizer."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray cluster for the integration tests (started once, shut down at the end)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    from ray import serve

    serve.shutdown()  # replicas stop gracefully: their vLLM engine processes would outlive a killed actor
    ray.shutdown()
