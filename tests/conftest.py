"""Session-wide fixtures: the tiny random target is built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_ray.tiny_target import build_tiny_target

REPO = Path(__file__).resolve().parents[1]


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
