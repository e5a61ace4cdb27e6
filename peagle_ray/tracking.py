"""MLflow: the tracking server (started locally when no URI is configured) and the run a training run logs to.

    with tracking_uri(cfg, work_dir) as uri:       # cfg.tracking.tracking_uri, or a local server for the run
        run_id = find_or_create_run(uri, cfg)       # same run name -> same MLflow run (resume)
        with run_status(uri, run_id):               # RUNNING, then FINISHED / FAILED / KILLED
            log_training_data(uri, run_id, cfg)     # the prepared data as the run's dataset input

The local server uses a sqlite backend and a local artifact store under `work_dir`, binds to loopback, and
is stopped when the block ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from peagle_ray.config import PeagleConfig

RUN_NAME_TAG = "peagle.run_name"


def flatten(prefix: str, value) -> dict[str, str]:
    """Nested config dict -> {"training.learning_rate": "0.0003", ...} for MLflow params."""
    if isinstance(value, dict):
        out = {}
        for key, inner in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else key, inner))
        return out
    return {prefix: str(value)[:500]}


@contextmanager
def local_mlflow_server(work_dir: Path, port: int, startup_timeout_s: float = 120):
    """`mlflow server` on 127.0.0.1:port with sqlite + local artifacts in work_dir; yields its URI."""
    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{work_dir / 'mlflow.db'}",
        "--artifacts-destination",
        str(work_dir / "mlartifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = (work_dir / "mlflow-server.log").open("w")
    process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {process.returncode}; see {work_dir / 'mlflow-server.log'}"
                )
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"mlflow server not ready after {startup_timeout_s:.0f}s") from None
                time.sleep(0.5)
        yield uri
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        log.close()


@contextmanager
def tracking_uri(cfg: PeagleConfig, work_dir: Path):
    if cfg.tracking.tracking_uri:
        yield cfg.tracking.tracking_uri
    else:
        with local_mlflow_server(work_dir, cfg.tracking.port) as uri:
            print(f"[mlflow] local tracking server at {uri} (sqlite in {work_dir})")
            yield uri


def find_or_create_run(uri: str, cfg: PeagleConfig, work_dir: Path) -> tuple[str, bool]:
    """(run id, created): the experiment's run tagged with training.run_name, made if missing.

    A database URI (sqlite:///...) has no artifact server: artifacts then go to work_dir/mlartifacts.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    if experiment:
        experiment_id = experiment.experiment_id
    else:
        local = None if uri.startswith("http") else (Path(work_dir).resolve() / "mlartifacts").as_uri()
        experiment_id = client.create_experiment(cfg.tracking.experiment, artifact_location=local)
    name = cfg.training.run_name
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{name}'", max_results=1)
    if runs:
        return runs[0].info.run_id, False
    run = client.create_run(experiment_id, run_name=name, tags={RUN_NAME_TAG: name})
    params = flatten("", cfg.model_dump(mode="json"))
    client.log_batch(run.info.run_id, params=[_param(k, v) for k, v in params.items()])
    return run.info.run_id, True


@contextmanager
def run_status(uri: str, run_id: str):
    """The run shows RUNNING inside the block (a resumed run too) and ends FINISHED, FAILED (an exception) or
    KILLED (Ctrl-C / SIGTERM: KeyboardInterrupt), with its end time, so the UI shows status and duration."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    client.update_run(run_id, status="RUNNING")
    try:
        yield
    except KeyboardInterrupt:
        client.set_terminated(run_id, "KILLED")
        raise
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")


def log_training_data(uri: str, run_id: str, cfg: PeagleConfig) -> None:
    """The prepared data (data.output_dir) as the run's MLflow dataset input (context "training"): source,
    digest of the prepared files, and a profile with row, token and bad-row counts from summary.json."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.tracking import MlflowClient

    out = Path(cfg.data.output_dir).resolve()
    summary = json.loads((out / "summary.json").read_text())
    digest = hashlib.sha256()
    for split in ("train", "validation"):
        if (out / f"{split}.jsonl").is_file():
            with (out / f"{split}.jsonl").open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    rows = summary.get("samples", {})
    profile = {
        "num_rows": sum(rows.values()),
        "train_rows": rows.get("train", 0),
        "validation_rows": rows.get("validation", 0),
        "tokens": summary.get("tokens"),
        "bad_rows": sum(summary.get("bad_rows", {}).values()),
        "bad_rows_by_reason": summary.get("bad_rows", {}),
    }
    dataset = Dataset(
        name="+".join(cfg.data.sources)[:200],
        digest=digest.hexdigest()[:16],
        source_type="local",
        source=json.dumps({"uri": out.as_uri(), "sources": cfg.data.sources}),
        profile=json.dumps(profile),
    )
    MlflowClient(uri).log_inputs(run_id, [DatasetInput(dataset, [InputTag("mlflow.data.context", "training")])])


def _param(key: str, value: str):
    from mlflow.entities import Param

    return Param(key, value)


def log_rows(
    uri: str,
    cfg: PeagleConfig,
    run_name: str,
    rows: list[dict],
    step_key: str,
    prefix: str,
    artifacts: list[Path],
    work_dir: Path,
) -> str:
    """A benchmark's rows as one finished run named `run_name`: every numeric field of a row becomes the metric
    `prefix/field` at step = row[step_key] (list fields: `prefix/field_1..n`); `artifacts` are attached.
    Returns the run id."""
    import math

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from peagle_ray.config import with_values

    client = MlflowClient(uri)
    run_id, _ = find_or_create_run(uri, with_values(cfg, {"training.run_name": run_name}), work_dir)
    now = int(1000 * time.time())
    metrics = []
    for row in rows:
        step = int(row[step_key])
        for key, value in row.items():
            values = value if isinstance(value, list) else [value]
            for i, v in enumerate(values):
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    name = f"{prefix}/{key}_{i + 1}" if isinstance(value, list) else f"{prefix}/{key}"
                    metrics.append(Metric(name, float(v), now, step))
    for i in range(0, len(metrics), 900):  # MLflow caps a batch at 1000 metrics
        client.log_batch(run_id, metrics=metrics[i : i + 900])
    for path in artifacts:
        client.log_artifact(run_id, str(path), artifact_path=prefix)
    client.set_terminated(run_id, "FINISHED")
    return run_id
