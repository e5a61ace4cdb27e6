"""The distributed training job's driver: Ray Train workers (train/worker.py) on the captured records, MLflow,
the export of the best checkpoint (train/checkpoint.py).

Driver (`run_training`): validates inputs before any worker starts, opens (or starts) MLflow and finds the
run for training.run_name, runs a TorchTrainer on the records (online: Ray Datasets of the capture through
the Serve-hosted target; offline: each worker reads its share of the shards itself, since Ray Data's
executor would spin a core waiting on the workers), then exports the best checkpoint and logs artifacts.

The workers' output does not reach the driver, so the driver's progress bar reads the run's MLflow metrics
(`tracking.metric_progress`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from peagle_ray import layout
from peagle_ray.config import ConfigError, PeagleConfig
from peagle_ray.train.checkpoint import CHECKPOINT_WEIGHTS, load_drafter_from_checkpoint
from peagle_ray.train.worker import WorkerPlan, train_worker

if TYPE_CHECKING:
    from peagle_ray.data.prepare import PreparedData
    from peagle_ray.target import TargetInfo


@dataclass(frozen=True)
class TrainInputs:
    """What training reads, checked before any worker starts (check_inputs)."""

    info: TargetInfo  # the target: path, shape, aux layers
    aux_layer_ids: list[int]
    data: PreparedData  # the data stage's artifact (its token counts give the draft vocabulary)
    feature_scale: list[float] | None = None  # drafter.normalize_features' per-channel scale


def check_inputs(cfg: PeagleConfig) -> TrainInputs:
    """Fail fast, before any worker starts: target, prepared data and (offline) captured shards must exist."""
    from peagle_ray.capture.pipeline import read_manifest
    from peagle_ray.data.prepare import PreparedData
    from peagle_ray.target import drafter_target

    info = drafter_target(cfg)
    data_dir = Path(cfg.data.output_dir)
    data = PreparedData.read(data_dir) if PreparedData.exists(data_dir) else None
    if data is None or not data.token_counts_file.is_file():
        raise FileNotFoundError(f"data.output_dir = {data_dir} has no prepared data; run `peagle-ray data prepare`")
    samples = data.samples
    if not samples.get("train"):
        raise ConfigError(
            f"data.output_dir = {data_dir} has no training samples (summary: {samples}); nothing to train on"
        )
    if not samples.get("validation"):
        raise ConfigError(
            f"data.output_dir = {data_dir} has no validation samples (summary: {samples}): checkpoints "
            f"are chosen by validation AL. Raise data.validation_fraction (now "
            f"{cfg.data.validation_fraction}) above 0 and run `peagle-ray data prepare` again"
        )
    if cfg.capture.mode == "offline":
        manifest = read_manifest(Path(cfg.capture.output_dir))
        captured = sum(split == "train" for shard in manifest["shards"] for split in shard["splits"])
        if not captured:
            raise ConfigError(
                f"capture.mode is offline but capture.output_dir = {cfg.capture.output_dir} holds no "
                "training records; run `peagle-ray data capture`"
            )
    init_from = cfg.training.init_from
    if init_from and not any((Path(init_from) / f).is_file() for f in ("model.safetensors", CHECKPOINT_WEIGHTS)):
        raise FileNotFoundError(
            f"training.init_from = {init_from} is not an exported drafter or a checkpoint "
            f"directory (model.safetensors or {CHECKPOINT_WEIGHTS})"
        )
    aux = info.aux_layer_ids(cfg.capture.aux_layer_ids)
    scale = feature_scale(cfg) if cfg.drafter.normalize_features else None
    return TrainInputs(info, list(aux), data, scale)


FEATURE_SCALE_RECORDS = 64


def feature_scale(cfg: PeagleConfig) -> list[float]:
    """drafter.normalize_features' per-channel scale, from the first captured training records."""
    import itertools

    from peagle_ray.capture.pipeline import read_split
    from peagle_ray.drafter.build import channel_scale

    if cfg.capture.mode != "offline":
        raise ConfigError(
            "drafter.normalize_features measures the captured features before training: it needs "
            f"capture.mode offline (got {cfg.capture.mode!r})"
        )
    records = itertools.islice(read_split(Path(cfg.capture.output_dir), "train"), FEATURE_SCALE_RECORDS)
    return channel_scale([r["aux_hidden"] for r in records]).tolist()


def check_shared_paths(cfg: PeagleConfig, storage: Path) -> None:
    """Refuse, before any worker starts, a directory the workers use that some node of the cluster cannot
    see: training.storage_path (checkpoints, unless training.checkpoint_uri holds them), data.output_dir (the
    draft vocabulary's token counts) and, offline, capture.output_dir (the shards)."""
    from peagle_ray.cluster import unshared_nodes

    paths = {"data.output_dir": Path(cfg.data.output_dir).resolve()}
    if cfg.training.checkpoint_uri is None:  # checkpoints in object storage need no shared disk
        paths["training.storage_path"] = storage
    if cfg.capture.mode == "offline":
        paths["capture.output_dir"] = Path(cfg.capture.output_dir).resolve()
    for field, path in paths.items():
        missing = unshared_nodes(path)
        if missing:
            raise ConfigError(
                f"{field} = {path} is a local path that node(s) {', '.join(missing)} of this multi-node "
                "cluster cannot see; use a directory shared by every node at the same path (NFS)"
                + (" or keep the checkpoints in object storage with training.checkpoint_uri (s3://bucket/path)"
                   if field == "training.storage_path" else "")
            )  # fmt: skip


def _score(metrics: dict) -> float:
    """A checkpoint's validation AL; a missing or NaN one never wins."""
    value = metrics.get(layout.VAL_ACCEPTANCE_LENGTH, float("nan"))
    return -math.inf if math.isnan(value) else value


def _fit(cfg: PeagleConfig, plan: WorkerPlan, train_ds=None, val_ds=None):
    """Run the TorchTrainer; online capture passes its Ray Datasets, offline workers read the shards."""
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    tcfg = cfg.training
    low, high = tcfg.worker_range
    trainer = TorchTrainer(
        train_worker,
        train_loop_config=dataclasses.asdict(plan),
        scaling_config=ScalingConfig(
            num_workers=high if low == high else (low, high),
            use_gpu=tcfg.use_gpu,
            resources_per_worker={"CPU": tcfg.cpus_per_worker},
            placement_strategy=tcfg.placement_strategy,
            elastic_resize_monitor_interval_s=tcfg.resize_check_s,
        ),
        run_config=RunConfig(
            name=cfg.training.run_name,
            storage_path=plan.storage_path,
            failure_config=FailureConfig(max_failures=cfg.training.max_failures),
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.training.checkpoints_to_keep,
                checkpoint_score_attribute=layout.VAL_ACCEPTANCE_LENGTH,
                checkpoint_score_order="max",
            ),
        ),
        datasets={"train": train_ds, "validation": val_ds} if train_ds is not None else None,
        dataset_config=DataConfig(datasets_to_split=["train"]),
    )
    # fit() installs a SIGINT handler (Ctrl-C aborts the run) and leaves it installed; put ours back so that
    # Ctrl-C still raises KeyboardInterrupt in whatever runs next (the demo's serving loop).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        return trainer.fit()
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)


@dataclass(frozen=True)
class TrainResult:
    """The training stage's artifact: the best checkpoint, its export (the drafter vLLM serves) and the MLflow
    run; written as <storage>/<run_name>/summary.json (layout.run_summary)."""

    run_id: str
    tracking_uri: str
    best_step: int | None
    best_metrics: dict[str, float]  # the best checkpoint's val/* metrics
    export_dir: str
    checkpoint: str  # the best checkpoint's directory (Ray Train's)
    registered_version: str | None  # the MLflow model version registered for the export, if any
    data_wait_share: float | None  # of the training time the slowest-fed worker waited for data (last report)


def run_training(cfg: PeagleConfig) -> TrainResult:
    """`peagle-ray train`: train a P-EAGLE or EAGLE-3 drafter with Ray Train on captured hidden states, export
    the best checkpoint, log everything to MLflow.

    Uses prepared data (and offline shards when capture.mode is offline; online mode captures while
    training). Starts a local MLflow server when tracking.tracking_uri is unset; re-running the same
    training.run_name resumes. `--dry-run` plans the run instead (train/plan.py: memory per worker, nothing
    loaded)."""
    from peagle_ray.cluster import ensure_ray
    from peagle_ray.tracking import find_or_create_run, log_training_data, metric_progress, run_status, tracking_uri

    inputs = check_inputs(cfg)
    storage = layout.storage(cfg)
    ensure_ray()
    check_shared_paths(cfg, storage)
    with tracking_uri(cfg, layout.mlflow_dir(storage)) as uri:
        run_id, created = find_or_create_run(uri, cfg, layout.mlflow_dir(storage))
        print(f"[train] MLflow run {run_id} ({'new' if created else 'resumed'}) at {uri}")
        with run_status(uri, run_id):
            log_training_data(uri, run_id, cfg, inputs.data.summary(), inputs.data.files())
            plan = worker_plan(cfg, inputs, uri, run_id, storage)
            with metric_progress(uri, run_id, cfg.training.max_steps, f"train {cfg.training.run_name}"):
                result = _fit(cfg, plan) if cfg.capture.mode == "offline" else _fit_online(cfg, plan)
            if result.error is not None:
                raise result.error
            best, best_metrics = max(result.best_checkpoints, key=lambda cm: _score(cm[1]))
            export = layout.export_dir(storage, cfg.training.run_name)
            _export_best(best, export, cfg, inputs, {"run_id": run_id, "best_step": best_metrics.get("step")})
            version = _log_artifacts(
                uri, run_id, cfg, layout.run_dir(storage, cfg.training.run_name), export, best_metrics
            )
    trained = TrainResult(
        run_id=run_id,
        tracking_uri=uri,
        best_step=best_metrics.get("step"),
        best_metrics={k: v for k, v in best_metrics.items() if k.startswith("val/")},
        export_dir=str(export),
        checkpoint=best.path,
        registered_version=version,
        data_wait_share=(result.metrics or {}).get(layout.DATA_WAIT_SHARE),
    )
    layout.run_summary(storage, cfg.training.run_name).write_text(json.dumps(asdict(trained), indent=2))
    al = best_metrics.get(layout.VAL_ACCEPTANCE_LENGTH, float("nan"))
    print(f"[train] best step {trained.best_step}: AL {al:.3f}; exported to {export}")
    if trained.data_wait_share is not None:
        print(f"[train] the workers waited for data {100 * trained.data_wait_share:.1f}% of the time")
    return trained


def worker_plan(cfg: PeagleConfig, inputs: TrainInputs, uri: str, run_id: str, storage: Path) -> WorkerPlan:
    """What every worker gets from the driver (the mask token chosen here: no worker loads the tokenizer)."""
    from peagle_ray.drafter.build import mask_token

    mask = mask_token(inputs.info.path, cfg.drafter)
    return WorkerPlan(
        config=cfg.model_dump(mode="json"),
        target_dir=str(inputs.info.path),
        aux_layer_ids=inputs.aux_layer_ids,
        token_counts=str(inputs.data.token_counts_file.resolve()),
        tracking_uri=uri,
        run_id=run_id,
        storage_path=cfg.training.checkpoint_uri or str(storage),
        crash_marker=str(layout.crash_marker(storage, cfg.training.run_name)),
        offline_dir=str(Path(cfg.capture.output_dir).resolve()) if cfg.capture.mode == "offline" else None,
        feature_scale=inputs.feature_scale,
        mask_token=None if mask is None else (mask.id, mask.source),
    )


def _fit_online(cfg: PeagleConfig, plan: WorkerPlan):
    """Capture through the Serve-hosted target while training: the training split streams as a Ray Dataset;
    the validation split is captured once up front (every validation measures the same records)."""
    import ray

    from peagle_ray.capture.pipeline import capture_dataset, iter_records, to_row
    from peagle_ray.capture.run import prepared_samples, target_session
    from peagle_ray.data.prepare import BadRows

    with target_session(cfg) as session:
        samples = prepared_samples(cfg)
        capture = lambda split: capture_dataset(  # noqa: E731
            [s for s in samples if s.split == split],
            session.num_layers_captured,
            session.info.hidden_size,
            cfg.capture.batch_size,
            cfg.capture.num_actors,
        )
        rows = iter_records(capture("validation").iter_rows(), BadRows(), desc="capture validation")
        validation = [to_row(record) for record in rows]
        return _fit(cfg, plan, capture("train"), ray.data.from_items(validation))


def _export_best(checkpoint, out_dir: Path, cfg: PeagleConfig, inputs: TrainInputs, provenance_extra: dict) -> Path:
    from peagle_ray.export.speculators import export_drafter

    with checkpoint.as_directory() as directory:
        drafter = load_drafter_from_checkpoint(Path(directory))
    return export_drafter(
        drafter,
        out_dir,
        inputs.info.path,
        inputs.aux_layer_ids,
        cfg.drafter.num_depths,
        cfg.target.max_model_len,
        provenance_extra,
    )


def _log_artifacts(
    uri: str, run_id: str, cfg: PeagleConfig, run_dir: Path, export_dir: Path, metrics: dict
) -> str | None:
    """Config, provenance, plot and the drafter into the run; returns the registered version (if any)."""
    from peagle_ray.config import dump_config
    from peagle_ray.export.speculators import provenance
    from peagle_ray.tracking import EXPORT_DIR_TAG, log_files, register_model

    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    (run_dir / "provenance.json").write_text(json.dumps(provenance(), indent=2))
    from peagle_ray.plots import acceptance_plot

    plot = acceptance_plot(metrics, run_dir / "acceptance.png", f"{cfg.drafter.algorithm}: validation acceptance")
    log_files(uri, run_id, [run_dir / "config.yaml", run_dir / "provenance.json", plot], dirs={"drafter": export_dir})
    if not cfg.tracking.registered_model:
        return None
    tags = {EXPORT_DIR_TAG: str(Path(export_dir).resolve())}  # served from here while it exists
    return register_model(uri, run_id, cfg.tracking.registered_model, "drafter", cfg.adapt.alias, tags)
