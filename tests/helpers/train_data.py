"""The tiny training data the Ray Train job's tests and the in-process benches' tests share (conftest's
`captured_data`: prepared and captured once per session through the Serve-hosted tiny target)."""

from peagle_ray.config import build_config
from peagle_ray.serve.app import free_port

PROMPTS = [
    "Write a haiku about rain.",
    "What is a socket?",
    "Sort a list in Python.",
    "Name three colors.",
    "Explain recursion briefly.",
    "Translate 'good morning' into French.",
    "What is 12 times 7?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
    "List two prime numbers.",
]
K = 3


def raw_config(tmp, tiny_target, **training) -> dict:
    """The tiny training run's config as a dict (test_multinode.py changes a few fields), prompts in
    tmp/prompts.txt, everything it writes under tmp."""
    return {
        "target": {"path": str(tiny_target), "max_model_len": 256, "kv_cache_gib": 1},
        "data": {
            "sources": [str(tmp / "prompts.txt")],
            "max_new_tokens": 24,
            "output_dir": str(tmp / "data"),
            "validation_fraction": 0.3,
        },
        "capture": {"mode": "offline", "output_dir": str(tmp / "hidden"), "batch_size": 8},
        "drafter": {"num_depths": K, "draft_vocab_size": 300},
        "training": {
            "num_workers": 2,
            "max_steps": 4,
            "validate_every": 2,
            "sequences_per_step": 1,
            "segment_length": 64,
            "storage_path": str(tmp / "train"),
            "epochs": 50,
            **training,
        },
        "tracking": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}"},
        "serving": {"port": free_port()},  # Serve's HTTP proxy (the capture target starts it): not 8000, which
        # the other xdist worker's cluster may hold
    }


def config(tmp, tiny_target, **training):
    return build_config(raw_config(tmp, tiny_target, **training))
