"""Every path and run name under training.storage_path, and the names of the metrics the stages share.

    <training.storage_path>/
        mlflow/                  the local MLflow server's sqlite store and artifacts (no tracking.tracking_uri)
        <run name>/              Ray Train's run: checkpoints, summary.json, export/ (the best drafter)
        <run name>.crashed       written by a worker that crashed (test hook: training.crash_at_step)
        eval/, eval-<suite>/     one evaluation per suite (eval.json, plots)
        adapt/<stamp>/           one adaptation (its data, capture and training run)
        bench/<kind>/            benchmarks' working files

The run of drafter.algorithm is named training.run_name; the other algorithm's run (the demo's EAGLE-3
baseline) adds its name as a suffix.
"""

from __future__ import annotations

from pathlib import Path

from peagle_ray.config import PeagleConfig

ALGORITHMS = ("eagle3", "peagle")

VAL_ACCEPTANCE_LENGTH = "val/acceptance_length"  # the checkpoint score and every table's AL
VAL_LOSS = "val/loss"
DATA_WAIT_SHARE = "train/data_wait_share"  # of a worker's time since its first batch, waiting for the next
VAL_ACCEPTANCE_POS = "val/acceptance_pos_"  # + draft position 1..K
STEPS_DONE = "progress/steps_done"  # rank 0's step count, written as it trains (not held to checkpoints): the bar


def acceptance_metric(position: int) -> str:
    """The validation acceptance rate of one draft position (1-based). e.g. 2 -> "val/acceptance_pos_2"."""
    return f"{VAL_ACCEPTANCE_POS}{position}"


def storage(cfg: PeagleConfig) -> Path:
    """training.storage_path, absolute (Ray Train and MLflow need absolute paths)."""
    return Path(cfg.training.storage_path).resolve()


def mlflow_dir(storage_path: str | Path) -> Path:
    return Path(storage_path) / "mlflow"


def run_dir(storage_path: str | Path, run_name: str) -> Path:
    return Path(storage_path) / run_name


def export_dir(storage_path: str | Path, run_name: str) -> Path:
    """Where the training job exports a run's best drafter: <storage>/<run name>/export."""
    return run_dir(storage_path, run_name) / "export"


def run_summary(storage_path: str | Path, run_name: str) -> Path:
    return run_dir(storage_path, run_name) / "summary.json"


def crash_marker(storage_path: str | Path, run_name: str) -> Path:
    return Path(storage_path) / f"{run_name}.crashed"


def run_name_for(cfg: PeagleConfig, algorithm: str) -> str:
    """training.run_name for drafter.algorithm; the other algorithm's run (the demo's baseline) adds a suffix."""
    return cfg.training.run_name if algorithm == cfg.drafter.algorithm else f"{cfg.training.run_name}-{algorithm}"


def drafter_dir(cfg: PeagleConfig) -> Path:
    """The export of this config's training run: what `serve` and `bench load` serve unless told otherwise."""
    return export_dir(cfg.training.storage_path, cfg.training.run_name)


def eval_name(suite: str) -> str:
    """The MLflow metric prefix and the directory name of a suite's results: eval (the validation split),
    eval-mt-bench, eval-humaneval. One suite's sweep never overwrites another's."""
    return "eval" if suite == "validation" else f"eval-{suite}"


def eval_dir(storage_path: str | Path, suite: str) -> Path:
    return Path(storage_path) / eval_name(suite)


def adapt_dir(storage_path: str | Path, stamp: str) -> Path:
    return Path(storage_path) / "adapt" / stamp


def bench_dir(cfg: PeagleConfig, kind: str) -> Path:
    return Path(cfg.training.storage_path) / "bench" / kind
