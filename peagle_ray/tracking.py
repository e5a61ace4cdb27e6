"""MLflow, all of it: the only module of peagle-ray that imports mlflow (an import-linter contract).

    with tracking_uri(cfg, work_dir) as uri:       # cfg.tracking.tracking_uri, or a local server for the run
        run_id = find_or_create_run(uri, cfg)       # same run name -> same MLflow run (resume)
        with run_status(uri, run_id):               # RUNNING, then FINISHED / FAILED / KILLED
            log_training_data(uri, run_id, cfg)     # the prepared data as the run's dataset input
            log = MetricLog(uri, run_id)            # a worker's log(step, metrics); flush() at each checkpoint
            with metric_progress(uri, run_id, total, "train"):   # the driver's bar, read from the run
                ...
            log_files(uri, run_id, [config, plot], dirs={"drafter": export_dir})
            register_model(uri, run_id, "peagle-drafter", "drafter", "serving")
    with results_run(uri, cfg, run_id, "eval-peagle", work_dir) as run_id:   # a run, or one made for results
        log_metrics(uri, run_id, [(name, value, step), ...]); set_tag(...); log_table(...)

The local server uses a sqlite backend and a local artifact store under `work_dir`, binds to loopback, and
is stopped when the block ends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from peagle_ray.config import ConfigError, PeagleConfig
from peagle_ray.layout import STEPS_DONE, VAL_ACCEPTANCE_LENGTH

logger = logging.getLogger(__name__)

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


def log_training_data(uri: str, run_id: str, cfg: PeagleConfig, summary: dict, files: list[Path]) -> None:
    """The prepared data (data.output_dir) as the run's MLflow dataset input (context "training"): source,
    digest of the prepared `files`, and a profile with row, token and bad-row counts from its `summary`."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.tracking import MlflowClient

    out = Path(cfg.data.output_dir).resolve()
    digest = hashlib.sha256()
    for path in files:
        if path.is_file():
            with path.open("rb") as f:
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


def metric_history(uri: str, run_id: str, name: str) -> list[tuple[int, float]]:
    """(step, value) of a metric, by step."""
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, name))


def metric_times(uri: str, run_id: str, name: str) -> list[tuple[int, float, float]]:
    """(step, value, seconds since the run started) of a metric, by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    start = client.get_run(run_id).info.start_time
    history = client.get_metric_history(run_id, name)
    return sorted((m.step, m.value, (m.timestamp - start) / 1000) for m in history)


def log_metrics(uri: str, run_id: str, metrics: list[tuple[str, float, int]]) -> None:
    """(name, value, step) triples in batches (MLflow caps a batch at 1000); NaN and infinities are left out."""
    import math

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    now = int(1000 * time.time())
    batch = [Metric(name, float(v), now, int(step)) for name, v, step in metrics if math.isfinite(float(v))]
    client = MlflowClient(uri)
    for i in range(0, len(batch), 900):
        client.log_batch(run_id, metrics=batch[i : i + 900])


class MetricLog:
    """Rank 0's `log(step, metrics)`: held until flush() (at each checkpoint) and then written in one batch, so a
    crash leaves neither gaps nor duplicates: on resume, steps already in the run (by train/loss) are skipped.
    Apart from those, the step count (layout.STEPS_DONE) is written as training goes, at most once every
    `progress_every_s`, for the driver's bar (metric_progress). Made with uri None (other ranks), it keeps nothing."""

    def __init__(
        self, uri: str | None, run_id: str | None, resume_metric: str = "train/loss", progress_every_s: float = 10.0
    ):
        self.uri, self.run_id = uri, run_id
        self.rows: list[tuple[int, dict[str, float]]] = []
        history = metric_history(uri, run_id, resume_metric) if uri and run_id else []
        self.logged_through = max((step for step, _ in history), default=-1)
        self.progress_every_s = progress_every_s
        self.progress_at = -math.inf

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if self.uri and step > self.logged_through:
            self.rows.append((step, metrics))
        if self.uri and self.run_id and time.monotonic() - self.progress_at >= self.progress_every_s:
            self.progress_at = time.monotonic()
            try:
                log_metrics(self.uri, self.run_id, [(STEPS_DONE, step + 1, step)])
            except Exception as error:  # noqa: BLE001 - a busy tracking server costs a bar update, not the run
                logger.warning("progress metric not written at step %d: %s", step, error)

    def flush(self) -> None:
        if self.rows and self.uri and self.run_id:
            log_metrics(self.uri, self.run_id, [(k, v, step) for step, row in self.rows for k, v in row.items()])
            self.logged_through = max(step for step, _ in self.rows)
        self.rows = []


@contextmanager
def metric_progress(
    uri: str, run_id: str, total: int, desc: str, metric: str = VAL_ACCEPTANCE_LENGTH, every_s: float = 5.0
):
    """A progress bar of training steps fed from the run's metrics, polled every `every_s` seconds: steps done
    = the later of rank 0's live step count (layout.STEPS_DONE) and the last step of `metric` + 1 (rank 0 writes
    its other metrics at each checkpoint; the workers' output does not reach the driver), postfix = the value
    of `metric`. Yields the tqdm bar; the last reading is taken when the block ends."""
    import threading

    from tqdm import tqdm

    stop = threading.Event()
    bar = tqdm(total=total, desc=desc, unit="step")

    def refresh() -> None:
        history = metric_history(uri, run_id, metric)
        written = metric_times(uri, run_id, STEPS_DONE)  # the latest written: a resumed run counts again
        done = int(max(written, key=lambda row: row[2])[1]) if written else 0
        if history:
            step, value = history[-1]
            done = max(done, step + 1)
            bar.set_postfix_str(f"val AL {value:.3f}", refresh=False)
        if done:
            bar.n = min(done, total)
            bar.refresh()

    def poll() -> None:
        while not stop.wait(every_s):
            try:
                refresh()
            except Exception:  # noqa: BLE001 - a busy tracking server: read again at the next tick
                pass

    refresh()
    thread = threading.Thread(target=poll, name="mlflow-progress", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
        try:
            refresh()
        finally:
            bar.close()


def log_files(
    uri: str, run_id: str, files: list[Path], artifact_path: str | None = None, dirs: dict[str, Path] | None = None
) -> None:
    """Files as artifacts (under artifact_path), and each directory's content under its key."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    for path in files:
        client.log_artifact(run_id, str(path), artifact_path=artifact_path)
    for key, directory in (dirs or {}).items():
        client.log_artifacts(run_id, str(directory), artifact_path=key)


EXPORT_DIR_TAG = "export_dir"  # a registered version's tag: the export it was registered from, on its machine


def register_model(uri: str, run_id: str, name: str, artifact_path: str, alias: str, tags: dict | None = None) -> str:
    """A new version of the registered model `name` (made if missing) from the run's artifacts; returns the
    version number. The first version of a model also gets `alias` (adapt.alias, "serving": what the endpoint
    and `peagle-ray adapt` start from); later ones get it only when promoted."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    try:
        client.create_registered_model(name)
    except MlflowException:
        pass  # already registered: add a version
    source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path}"
    # MLflow logs "Waiting up to 300 seconds for model version to finish creation" at INFO on every version
    logging.getLogger("mlflow.store.model_registry.abstract_store").setLevel(logging.WARNING)
    version = client.create_model_version(name, source, run_id=run_id, tags=tags or {}).version
    if not client.get_registered_model(name).aliases:
        client.set_registered_model_alias(name, alias, version)
    return str(version)


def register_export(uri: str, cfg: PeagleConfig, run_name: str, export: Path, work_dir: Path) -> str:
    """An exported drafter registered as a new version of tracking.registered_model, from a run named
    run_name that holds it as the artifact `drafter`; returns the version."""
    from peagle_ray.config import with_values

    name = cfg.tracking.registered_model
    if not name:
        raise ConfigError("registering a drafter needs tracking.registered_model; got None")
    run_id, _ = find_or_create_run(uri, with_values(cfg, {"training.run_name": run_name}), work_dir)
    log_files(uri, run_id, [], dirs={"drafter": export})
    return register_model(uri, run_id, name, "drafter", cfg.adapt.alias, {EXPORT_DIR_TAG: str(Path(export).resolve())})


def aliased_version(uri: str, name: str, alias: str) -> dict | None:
    """{version, run_id, source, tags} of the version of `name` holding `alias`; None when the model or
    the alias does not exist."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        v = MlflowClient(uri).get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    return {"version": str(v.version), "run_id": v.run_id, "source": v.source, "tags": dict(v.tags)}


def set_alias(uri: str, name: str, alias: str, version: str) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).set_registered_model_alias(name, alias, version)


def set_version_tags(uri: str, name: str, version: str, tags: dict) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, str(value))


def model_tags(uri: str, name: str) -> dict[str, str]:
    """The registered model's own tags ({} when it does not exist)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        return dict(MlflowClient(uri).get_registered_model(name).tags)
    except MlflowException:
        return {}


def set_model_tags(uri: str, name: str, tags: dict) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    for key, value in tags.items():
        client.set_registered_model_tag(name, key, str(value))


def download_version(uri: str, name: str, version: str, dst: Path) -> Path:
    """The files of a registered version (an exported drafter) in dst; returns dst."""
    import mlflow.artifacts
    from mlflow.tracking import MlflowClient

    source = MlflowClient(uri).get_model_version_download_uri(name, version)
    dst.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dst), tracking_uri=uri))


def set_tag(uri: str, run_id: str, key: str, value) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).set_tag(run_id, key, value)


def log_table(uri: str, run_id: str, table: dict[str, list], artifact_file: str) -> None:
    """Columns as an MLflow table (MLflow appends the rows of each call to the file's rows)."""
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).log_table(run_id, table, artifact_file)


def run_exists(uri: str, run_id: str | None) -> bool:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if not run_id:
        return False
    try:
        MlflowClient(uri).get_run(run_id)
        return True
    except MlflowException:
        return False


@contextmanager
def results_run(uri: str, cfg: PeagleConfig, run_id: str | None, fallback_name: str, work_dir: Path):
    """Yields `run_id` when that run is in this store (results join the run that trained the drafter, whose
    status they leave alone); else the run named fallback_name (made if missing), with run_status's statuses:
    RUNNING inside the block, then FINISHED, FAILED (an exception) or KILLED (Ctrl-C)."""
    from peagle_ray.config import with_values

    if run_exists(uri, run_id):
        yield run_id
        return
    run_id, _ = find_or_create_run(uri, with_values(cfg, {"training.run_name": fallback_name}), work_dir)
    with run_status(uri, run_id):
        yield run_id


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
    metrics = []
    for row in rows:
        for key, value in row.items():
            values = value if isinstance(value, list) else [value]
            for i, v in enumerate(values):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    name = f"{prefix}/{key}_{i + 1}" if isinstance(value, list) else f"{prefix}/{key}"
                    metrics.append((name, v, row[step_key]))
    with results_run(uri, cfg, None, run_name, work_dir) as run_id:
        log_metrics(uri, run_id, metrics)
        log_files(uri, run_id, artifacts, artifact_path=prefix)
    return run_id
