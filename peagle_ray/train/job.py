"""The distributed training job: Ray Train workers on the captured-record stream, MLflow, checkpoints.

Driver (`run_training`): validates inputs before any worker starts, opens (or starts) MLflow and finds the
run for training.run_name, runs a TorchTrainer on the records (online: Ray Datasets of the capture through
the Serve-hosted target; offline: each worker reads its share of the shards itself, since Ray Data's
executor would spin a core waiting on the workers), then exports the best checkpoint and logs artifacts.

Worker (`train_worker`): builds the drafter (same seed on every rank), resumes from Ray Train's latest
checkpoint if there is one, and loops: sequences_per_step records -> `sequence_backward` (COD, masks,
partitioning) -> gradients all-reduced over the workers -> clip -> AdamW step. Every validate_every steps
rank 0 measures the validation split (per-depth accuracy, offline greedy acceptance per position, AL),
flushes its buffered metrics to MLflow (`tracking.MetricLog`), then every rank reports and rank 0 attaches the checkpoint.
Metrics are flushed before the checkpoint that covers them, and on resume steps already in MLflow are not
logged again, so a crash leaves neither gaps nor duplicates in the metric history. The workers' output does
not reach the driver, so the driver's progress bar reads the run's MLflow metrics (`tracking.metric_progress`).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import resource
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from peagle_ray.config import ConfigError, PeagleConfig
from peagle_ray.drafter.build import drafter_for_target
from peagle_ray.drafter.replay import Acceptance, replay_greedy
from peagle_ray.tracking import MetricLog
from peagle_ray.train.elements import TrainSequence
from peagle_ray.train.step import StepStats, make_optimizer, sample_elements, sequence_backward, train_step

CHECKPOINT_WEIGHTS = "drafter.safetensors"
CHECKPOINT_OPTIMIZER = "optimizer.pt"
CHECKPOINT_STATE = "state.json"


def to_sequence(record: dict) -> TrainSequence:
    """A captured record (numpy or torch fields) -> a training sequence."""
    t = lambda key, dtype: torch.as_tensor(record[key]).to(dtype)  # noqa: E731
    return TrainSequence.from_record(
        t("input_ids", torch.long),
        t("loss_mask", torch.long),
        t("aux_hidden", torch.float32),
        t("last_hidden", torch.float32),
    )


def full_batches(records: Iterator[dict], size: int) -> Iterator[list[TrainSequence]]:
    """Consecutive batches of `size` training sequences; a short tail is dropped."""
    while len(batch := [to_sequence(r) for r in itertools.islice(records, size)]) == size:
        yield batch


def cycle_records(shard, epochs: int) -> Iterator[dict]:
    """Rows of a dataset shard, epoch after epoch (each epoch re-streams; online mode re-captures)."""
    for _ in range(epochs):
        yield from shard.iter_rows()


def all_reduce_mean(tensors: list[torch.Tensor], world: int) -> None:
    if world > 1:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        torch.distributed.all_reduce(flat)
        flat /= world
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def all_reduce_stats(stats: StepStats, world: int) -> StepStats:
    if world > 1:
        k = len(stats.depth_count)
        flat = torch.tensor(
            [stats.loss, *stats.depth_kl, *stats.depth_correct, *stats.depth_count], dtype=torch.float64
        )
        torch.distributed.all_reduce(flat)
        stats.loss = float(flat[0]) / world
        stats.depth_kl = flat[1 : 1 + k].tolist()
        stats.depth_correct = [int(x) for x in flat[1 + k : 1 + 2 * k]]
        stats.depth_count = [int(x) for x in flat[1 + 2 * k :]]
    return stats


def step_throughput(positions: int, seconds: float, world: int, device: torch.device) -> dict[str, float]:
    """Base tokens/s of the whole step (all workers' positions over the slowest worker's time) and the
    largest per-worker peak memory so far (RSS on CPU, allocated memory on GPU)."""
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    total = torch.tensor([float(positions)], dtype=torch.float64)
    slowest = torch.tensor([seconds, peak_mb], dtype=torch.float64)
    if world > 1:
        torch.distributed.all_reduce(total)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    return {"train/tokens_per_s": float(total[0] / slowest[0]), "train/peak_memory_mb": float(slowest[1])}


def broadcast_from_rank0(value: dict, world: int) -> dict:
    if world > 1:
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value


def validation_subset(rows, tcfg) -> list[dict]:
    """The validation records measured: in sample-id order (the read order is not fixed), the first
    training.validation_records of them."""
    return sorted(rows, key=lambda r: r["sample_id"])[: tcfg.validation_records]


def validate(drafter, teacher, records: list[dict], cfg: PeagleConfig, generator) -> dict[str, float]:
    """Per-depth accuracy and loss on validation records, and offline greedy acceptance per position."""
    drafter.eval()
    replayer = drafter if drafter.embed_tokens.weight.device.type == "cpu" else copy.deepcopy(drafter).cpu()
    stats = StepStats()
    k_draft = cfg.drafter.num_depths
    acceptance = Acceptance(k_draft)
    for record in records:
        seq = to_sequence(record)
        elements, dense = sample_elements(seq, cfg.drafter, generator)
        stats.add(
            sequence_backward(
                drafter,
                teacher,
                seq,
                elements,
                cfg.training.segment_length,
                cfg.training.depth_weights,
                scale=1 / len(records),
                dense_mask=dense,
                backward=False,
                bf16=cfg.training.precision == "bfloat16",
            )
        )
        ids, loss_mask = torch.as_tensor(record["input_ids"]).long(), torch.as_tensor(record["loss_mask"]).bool()
        start = int(loss_mask.nonzero()[0]) if loss_mask.any() else len(ids)  # replay the assistant's answer
        replay_greedy(replayer, ids, torch.as_tensor(record["aux_hidden"]).float(), start, k_draft, acceptance)
    drafter.train()
    metrics = {"val/loss": stats.loss, "val/acceptance_length": acceptance.acceptance_length}
    metrics.update({f"val/acc_depth_{d}": a for d, a in enumerate(stats.accuracy()) if not math.isnan(a)})
    metrics.update({f"val/acceptance_pos_{i + 1}": r for i, r in enumerate(acceptance.rates())})
    return metrics


def save_checkpoint(directory: Path, drafter, optimizer, scheduler, generator, state: dict) -> None:
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(directory / CHECKPOINT_WEIGHTS))
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "generator": generator.get_state()},
        directory / CHECKPOINT_OPTIMIZER,
    )
    (directory / CHECKPOINT_STATE).write_text(json.dumps({**state, "arch": json.loads(drafter.arch.to_json())}))


def load_checkpoint(directory: Path, drafter, optimizer, scheduler, generator) -> dict:
    drafter.load_state_dict(load_file(str(directory / CHECKPOINT_WEIGHTS)))
    extra = torch.load(directory / CHECKPOINT_OPTIMIZER, weights_only=True)  # tensors and numbers only
    optimizer.load_state_dict(extra["optimizer"])
    scheduler.load_state_dict(extra["scheduler"])
    generator.set_state(extra["generator"])
    return json.loads((directory / CHECKPOINT_STATE).read_text())


def train_worker(plan: dict) -> None:
    """Runs on every Ray Train worker. `plan` is plain data prepared by the driver."""
    import ray.train
    import ray.train.torch

    from peagle_ray.capture.pipeline import read_split

    cfg = PeagleConfig.model_validate(plan["config"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    counts = load_file(plan["token_counts"])["counts"]
    drafter, teacher, _ = drafter_for_target(
        Path(plan["target_dir"]),
        cfg.drafter,
        counts,
        len(plan["aux_layer_ids"]),
        torch.Generator().manual_seed(cfg.training.seed),
        init_from=cfg.training.init_from,
    )
    device = ray.train.torch.get_device() if cfg.training.use_gpu else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(cfg.training.cpus_per_worker)  # whatever OMP_NUM_THREADS the process inherited
    drafter, teacher = drafter.to(device), teacher.to(device)
    optimizer, scheduler = make_optimizer(drafter, cfg.training)
    generator = torch.Generator().manual_seed(cfg.training.seed + 1000 * rank)  # COD differs per rank
    state = {
        "step": 0,
        "best_al": -1.0,
        "best_step": None,
        "target_dir": plan["target_dir"],
        "aux_layer_ids": plan["aux_layer_ids"],
        "num_speculative_tokens": cfg.drafter.num_depths,
        "max_model_len": cfg.target.max_model_len,
    }  # what a standalone export needs
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = load_checkpoint(Path(directory), drafter, optimizer, scheduler, generator)
    log = MetricLog(plan["tracking_uri"], plan["run_id"]) if rank == 0 else MetricLog(None, None)
    if plan["offline_dir"]:  # each rank reads its share of the shards itself: no Ray Data executor to feed
        shards = Path(plan["offline_dir"])
        validation_rows = read_split(shards, "validation") if rank == 0 else []
        records = (r for _ in range(cfg.training.epochs) for r in read_split(shards, "train", rank, world))
    else:
        validation_rows = ray.train.get_dataset_shard("validation").iter_rows() if rank == 0 else []
        records = cycle_records(ray.train.get_dataset_shard("train"), cfg.training.epochs)
    validation = validation_subset(validation_rows, cfg.training)
    tcfg, k = cfg.training, cfg.drafter.trained_depths

    batches = full_batches(records, tcfg.sequences_per_step)
    batch = next(batches, None)
    for step in range(state["step"], tcfg.max_steps):
        if batch is None:
            break  # data exhausted (epochs done); equal shares end every rank together
        if tcfg.crash_once_at_step == step and rank == min(1, world - 1) and not Path(plan["crash_marker"]).exists():
            Path(plan["crash_marker"]).write_text(f"crashed at step {step}")
            raise RuntimeError(f"injected failure at step {step} (training.crash_once_at_step)")
        next_batch = next(batches, None)  # read ahead: the step before the data runs out is a last step too
        started = time.perf_counter()
        stats = train_step(
            drafter,
            teacher,
            optimizer,
            scheduler,
            batch,
            cfg.drafter,
            tcfg,
            generator,
            reduce_grads=lambda grads: all_reduce_mean(grads, world),
        )
        speed = step_throughput(stats.positions, time.perf_counter() - started, world, device)
        stats = all_reduce_stats(stats, world)
        metrics = {
            "train/loss": stats.loss,
            "train/grad_norm": stats.grad_norm,
            "train/lr": scheduler.get_last_lr()[0],
            "train/elements": stats.elements,
            "train/segments": stats.segments,
            **speed,
        }
        metrics.update({f"train/acc_depth_{d}": a for d, a in enumerate(stats.accuracy()[:k]) if not math.isnan(a)})
        if step % tcfg.log_every == 0:
            log(step, metrics)

        last = step == tcfg.max_steps - 1 or next_batch is None
        batch = next_batch
        if (step + 1) % tcfg.validate_every == 0 or last:
            val = (
                validate(drafter, teacher, validation, cfg, torch.Generator().manual_seed(tcfg.seed))
                if rank == 0
                else {}
            )
            val = broadcast_from_rank0(val, world)  # every rank reports the same metrics (checkpoint scoring)
            log(step, val)
            report = {"step": step, **metrics, **val}
            if val["val/acceptance_length"] > state["best_al"]:
                state.update(best_al=val["val/acceptance_length"], best_step=step)
            log.flush()
            state["step"] = step + 1
            with tempfile.TemporaryDirectory() as tmp:
                if rank == 0:
                    save_checkpoint(Path(tmp), drafter, optimizer, scheduler, generator, state)
                ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(tmp) if rank == 0 else None)


# ---- driver ------------------------------------------------------------------------------------------


def check_inputs(cfg: PeagleConfig) -> dict:
    """Fail fast, before any worker starts: target, prepared data and (offline) captured shards must exist."""
    from peagle_ray.capture.pipeline import read_manifest
    from peagle_ray.data.prepare import TOKEN_COUNTS
    from peagle_ray.target import read_target_info, resolve_target_path

    info = read_target_info(resolve_target_path(cfg))
    data_dir = Path(cfg.data.output_dir)
    summary_file = data_dir / "summary.json"
    if not summary_file.is_file() or not (data_dir / TOKEN_COUNTS).is_file():
        raise FileNotFoundError(f"data.output_dir = {data_dir} has no prepared data; run `peagle-ray data prepare`")
    samples = json.loads(summary_file.read_text())["samples"]
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
    aux = cfg.capture.aux_layer_ids or info.default_aux_layer_ids()
    return {"info": info, "aux_layer_ids": aux, "token_counts": str((data_dir / TOKEN_COUNTS).resolve())}


def _score(metrics: dict) -> float:
    """A checkpoint's validation AL; a missing or NaN one never wins."""
    value = metrics.get("val/acceptance_length", float("nan"))
    return -math.inf if math.isnan(value) else value


def load_drafter_from_checkpoint(directory: Path):
    """The drafter saved in a training checkpoint directory."""
    from peagle_ray.drafter.model import Drafter, DrafterArch

    arch = DrafterArch(**json.loads((directory / CHECKPOINT_STATE).read_text())["arch"])
    drafter = Drafter(arch)
    drafter.load_state_dict(load_file(str(directory / CHECKPOINT_WEIGHTS)))
    return drafter


def acceptance_plot(metrics: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = sorted(int(k.rsplit("_", 1)[1]) for k in metrics if k.startswith("val/acceptance_pos_"))
    rates = [100 * metrics[f"val/acceptance_pos_{i}"] for i in positions]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(positions, rates, color="#3b7dd8")
    ax.set(xlabel="draft position", ylabel="accepted (%)", title=title, ylim=(0, 100), xticks=positions)
    for x, y in zip(positions, rates):
        ax.text(x, y + 1, f"{y:.1f}", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _fit(cfg: PeagleConfig, plan: dict, train_ds=None, val_ds=None):
    """Run the TorchTrainer; online capture passes its Ray Datasets, offline workers read the shards."""
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_worker,
        train_loop_config=plan,
        scaling_config=ScalingConfig(
            num_workers=cfg.training.num_workers,
            use_gpu=cfg.training.use_gpu,
            resources_per_worker={"CPU": cfg.training.cpus_per_worker},
        ),
        run_config=RunConfig(
            name=cfg.training.run_name,
            storage_path=plan["storage_path"],
            failure_config=FailureConfig(max_failures=cfg.training.max_failures),
            checkpoint_config=CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="val/acceptance_length", checkpoint_score_order="max"
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


def run_training(cfg: PeagleConfig) -> dict:
    """Train, export the best checkpoint, log everything to MLflow; returns a summary."""
    import ray

    from peagle_ray.capture.pipeline import capture_dataset, iter_records
    from peagle_ray.capture.run import ensure_ray, prepared_samples, target_session
    from peagle_ray.data.prepare import BadRows
    from peagle_ray.export.speculators import export_drafter, provenance
    from peagle_ray.tracking import find_or_create_run, log_training_data, metric_progress, run_status, tracking_uri

    inputs = check_inputs(cfg)
    storage = Path(cfg.training.storage_path).resolve()
    run_dir = storage / cfg.training.run_name
    ensure_ray()
    with tracking_uri(cfg, storage / "mlflow") as uri:
        run_id, created = find_or_create_run(uri, cfg, storage / "mlflow")
        print(f"[train] MLflow run {run_id} ({'new' if created else 'resumed'}) at {uri}")
        with run_status(uri, run_id):
            log_training_data(uri, run_id, cfg)
            plan = {
                "config": cfg.model_dump(mode="json"),
                "target_dir": str(inputs["info"].path),
                "aux_layer_ids": inputs["aux_layer_ids"],
                "token_counts": inputs["token_counts"],
                "tracking_uri": uri,
                "run_id": run_id,
                "storage_path": str(storage),
                "crash_marker": str(storage / f"{cfg.training.run_name}.crashed"),
                "offline_dir": str(Path(cfg.capture.output_dir).resolve()) if cfg.capture.mode == "offline" else None,
            }
            progress = metric_progress(uri, run_id, cfg.training.max_steps, f"train {cfg.training.run_name}")
            if cfg.capture.mode == "offline":
                with progress:
                    result = _fit(cfg, plan)
            else:
                with target_session(cfg) as session:
                    samples = prepared_samples(cfg)
                    train = capture_dataset(
                        [s for s in samples if s.split == "train"],
                        session.num_layers_captured,
                        session.info.hidden_size,
                        cfg.capture.batch_size,
                        cfg.capture.num_actors,
                    )
                    bad = BadRows()
                    val_rows = capture_dataset(
                        [s for s in samples if s.split == "validation"],
                        session.num_layers_captured,
                        session.info.hidden_size,
                        cfg.capture.batch_size,
                        cfg.capture.num_actors,
                    )
                    validation = [
                        {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in r.items()}
                        for r in iter_records(val_rows.iter_rows(), bad, desc="capture validation")
                    ]
                    with progress:
                        result = _fit(cfg, plan, train, ray.data.from_items(validation))
            if result.error is not None:
                raise result.error
            best, best_metrics = max(result.best_checkpoints, key=lambda cm: _score(cm[1]))
            with best.as_directory() as directory:
                drafter = load_drafter_from_checkpoint(Path(directory))
            export_dir = export_drafter(
                drafter,
                run_dir / "export",
                inputs["info"].path,
                inputs["aux_layer_ids"],
                cfg.drafter.num_depths,
                cfg.target.max_model_len,
                {"run_id": run_id, "best_step": best_metrics.get("step")},
            )
            _log_artifacts(uri, run_id, cfg, run_dir, export_dir, best_metrics, provenance())
    summary = {
        "run_id": run_id,
        "tracking_uri": uri,
        "best_step": best_metrics.get("step"),
        "best_metrics": {k: v for k, v in best_metrics.items() if k.startswith("val/")},
        "export_dir": str(export_dir),
        "checkpoint": best.path,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"[train] best step {summary['best_step']}: AL {best_metrics.get('val/acceptance_length', float('nan')):.3f}; "
        f"exported to {export_dir}"
    )
    return summary


def _log_artifacts(
    uri: str, run_id: str, cfg: PeagleConfig, run_dir: Path, export_dir: Path, metrics: dict, provenance_record: dict
) -> None:
    from peagle_ray.config import dump_config
    from peagle_ray.tracking import log_files, register_model

    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    (run_dir / "provenance.json").write_text(json.dumps(provenance_record, indent=2))
    plot = acceptance_plot(metrics, run_dir / "acceptance.png", f"{cfg.drafter.algorithm}: validation acceptance")
    log_files(uri, run_id, [run_dir / "config.yaml", run_dir / "provenance.json", plot], dirs={"drafter": export_dir})
    if cfg.tracking.registered_model:
        register_model(uri, run_id, cfg.tracking.registered_model, "drafter")


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, num_speculative_tokens: int | None = None) -> Path:
    """`peagle-ray export`: a training checkpoint directory -> the speculators format."""
    from peagle_ray.export.speculators import export_drafter

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / CHECKPOINT_STATE).is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a peagle-ray training checkpoint (no {CHECKPOINT_STATE})")
    state = json.loads((checkpoint_dir / CHECKPOINT_STATE).read_text())
    drafter = load_drafter_from_checkpoint(checkpoint_dir)
    return export_drafter(
        drafter,
        out_dir,
        Path(state["target_dir"]),
        state["aux_layer_ids"],
        num_speculative_tokens or state["num_speculative_tokens"],
        state["max_model_len"],
        {"checkpoint": str(checkpoint_dir), "step": state["step"]},
    )
