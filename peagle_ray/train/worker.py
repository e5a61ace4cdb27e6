"""The Ray Train worker loop: records -> steps -> validation -> metrics and checkpoints (rank 0).

Every rank builds the drafter (same seed), resumes from Ray Train's latest checkpoint if there is one, and
loops: sequences_per_step records -> `train_step` (COD, masks, partitioning; gradients averaged over the
workers by torch DDP, from ray.train.torch.prepare_model, in the step's last backward) -> clip -> AdamW step. Every validate_every steps rank 0 measures the validation split
(per-depth accuracy, offline greedy acceptance per position, AL), flushes its held metrics to MLflow
(`tracking.MetricLog`), then every rank reports and rank 0 attaches the checkpoint (train/checkpoint.py).
Metrics are flushed before the checkpoint that covers them, and on resume steps already in MLflow are not
logged again, so a crash leaves neither gaps nor duplicates in the metric history.
"""

from __future__ import annotations

import copy
import itertools
import math
import resource
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file

from peagle_ray import layout
from peagle_ray.config import PeagleConfig
from peagle_ray.drafter.build import drafter_for_target
from peagle_ray.drafter.replay import Acceptance, replay_greedy
from peagle_ray.drafter.vocab import MaskToken
from peagle_ray.tracking import MetricLog
from peagle_ray.train.checkpoint import load_checkpoint, save_checkpoint
from peagle_ray.train.elements import TrainSequence
from peagle_ray.train.step import SegmentLoss, StepStats, make_optimizer, sampled_sequence_backward, train_step

if TYPE_CHECKING:
    from peagle_ray.capture.pipeline import Record


def to_sequence(record: Record) -> TrainSequence:
    """A captured record -> a training sequence."""
    return TrainSequence.from_record(
        record["input_ids"].long(),
        record["loss_mask"].long(),
        record["aux_hidden"].float(),
        record["last_hidden"].float(),
    )


def full_batches(records: Iterator[Record], size: int) -> Iterator[list[TrainSequence]]:
    """Consecutive batches of `size` training sequences; a short tail is dropped."""
    while len(batch := [to_sequence(r) for r in itertools.islice(records, size)]) == size:
        yield batch


def cycle_records(shard, epochs: int, cache_bytes: int = 0) -> Iterator[Record]:
    """Records of a dataset shard, epoch after epoch; a capture's error rows are counted, reported at the end
    of the epoch and skipped. The first epoch's records also go into a local spill file of at most
    `cache_bytes`, which later epochs replay instead of re-streaming the shard (online mode: capturing every
    record through the target again); a first epoch larger than that re-streams every epoch."""
    from peagle_ray.capture.pipeline import valid_records
    from peagle_ray.data.prepare import BadRows

    with EpochCache(cache_bytes) as cache:
        for epoch in range(epochs):
            if epoch and cache.complete:
                yield from cache.replay()
                continue
            bad = BadRows()
            for record in valid_records(shard.iter_rows(), bad):
                if not epoch:
                    cache.add(record)
                yield record
            cache.close_writing()
            if bad.total():
                print(f"[train] epoch {epoch}: capture {bad.report()}", flush=True)


class EpochCache:
    """Records appended to a temp file as numpy arrays (np.save, no pickle), in order, then read back in order.
    Past `limit` bytes it gives up (deletes the file; `complete` stays False)."""

    def __init__(self, limit: int):
        self.limit, self.size, self.rows = limit, 0, 0
        self.keys: list[str] = []  # the first row's, sorted; every row must have the same
        self.dtypes: dict[str, str] = {}  # the first row's tensors' dtypes (torch names), likewise
        self._dir = tempfile.TemporaryDirectory(prefix="peagle-epoch-cache-") if limit > 0 else None
        self._file = open(Path(self._dir.name) / "rows.npy", "wb") if self._dir else None  # noqa: SIM115

    def add(self, row: Record) -> None:
        if self._file is None:
            return
        from peagle_ray.capture.pipeline import as_array, dtype_name

        arrays = {k: as_array(v) if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in row.items()}
        dtypes = {k: dtype_name(v.dtype) for k, v in row.items() if isinstance(v, torch.Tensor)}
        self.keys, self.dtypes = self.keys or sorted(arrays), self.dtypes or dtypes
        self.size += sum(a.nbytes for a in arrays.values())
        if self.size > self.limit or sorted(arrays) != self.keys or dtypes != self.dtypes:
            self._give_up()
            return
        for key in self.keys:
            np.save(self._file, arrays[key], allow_pickle=False)
        self.rows += 1

    @property
    def complete(self) -> bool:
        """Every row of the first epoch is in the file: writing ended without giving up."""
        return self._dir is not None and self._file is None

    def close_writing(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def replay(self) -> Iterator[Record]:
        from peagle_ray.capture.pipeline import as_tensor, make_record

        assert self._dir is not None, "replay() after complete() said True"
        with open(Path(self._dir.name) / "rows.npy", "rb") as f:
            for _ in range(self.rows):
                arrays = {key: np.load(f, allow_pickle=False) for key in self.keys}
                # saved from a Record's tensors: their dtypes already, and freshly read, so no copy is needed
                tensors = {key: as_tensor(arrays[key], dtype, copy=False) for key, dtype in self.dtypes.items()}
                yield make_record(str(arrays["sample_id"].item()), str(arrays["split"].item()), tensors.__getitem__)

    def _give_up(self) -> None:
        self.close_writing()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EpochCache:
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
        if self._dir is not None:
            self._dir.cleanup()


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


def step_throughput(
    positions: int, seconds: float, world: int, device: torch.device, wait_share: float = 0.0
) -> dict[str, float]:
    """Base tokens/s of the whole step (all workers' positions over the slowest worker's time), the largest
    per-worker peak memory so far (RSS on CPU, allocated memory on GPU) and the largest share of a worker's
    time so far spent waiting for its data (`wait_share`, see DataWait)."""
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    total = torch.tensor([float(positions)], dtype=torch.float64)
    slowest = torch.tensor([seconds, peak_mb, wait_share], dtype=torch.float64)
    if world > 1:
        torch.distributed.all_reduce(total)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    return {
        "train/tokens_per_s": float(total[0] / slowest[0]),
        "train/peak_memory_mb": float(slowest[1]),
        layout.DATA_WAIT_SHARE: float(slowest[2]),
    }


class DataWait:
    """How long the loop waits for its next batch against the time it trains: the share of the run since the
    first batch spent waiting (the first batch's wait, the data pipeline starting, is kept apart)."""

    def __init__(self) -> None:
        self.first_s: float | None = None
        self.waited, self.trained = 0.0, 0.0

    def read(self, batches: Iterator):
        start = time.perf_counter()
        batch = next(batches, None)
        if self.first_s is None:
            self.first_s = time.perf_counter() - start
        else:
            self.waited += time.perf_counter() - start
        return batch

    @property
    def share(self) -> float:
        return self.waited / max(self.waited + self.trained, 1e-9)


def broadcast_from_rank0(value: dict, world: int) -> dict:
    if world > 1:
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value


def validation_subset(rows, tcfg) -> list[Record]:
    """The validation records measured: those whose sample id starts with training.validation_prefix, in
    sample-id order (the read order is not fixed), the first training.validation_records of them."""
    kept = (r for r in rows if r["sample_id"].startswith(tcfg.validation_prefix))
    return sorted(kept, key=lambda r: r["sample_id"])[: tcfg.validation_records]


def validate(drafter, teacher, records: list[Record], cfg: PeagleConfig, generator) -> dict[str, float]:
    """Per-depth accuracy and loss on validation records, and offline greedy acceptance per position."""
    drafter.eval()
    replayer = drafter if drafter.embed_tokens.weight.device.type == "cpu" else copy.deepcopy(drafter).cpu()
    stats = StepStats()
    k_draft = cfg.drafter.num_depths
    acceptance = Acceptance(k_draft)
    for record in records:
        seq = to_sequence(record)
        scale = 1 / len(records)
        stats.add(sampled_sequence_backward(drafter, teacher, seq, cfg.drafter, cfg.training, generator, scale, False))
        ids, loss_mask = torch.as_tensor(record["input_ids"]).long(), torch.as_tensor(record["loss_mask"]).bool()
        start = int(loss_mask.nonzero()[0]) if loss_mask.any() else len(ids)  # replay the assistant's answer
        replay_greedy(replayer, ids, torch.as_tensor(record["aux_hidden"]).float(), start, k_draft, acceptance)
    drafter.train()
    metrics = {layout.VAL_LOSS: stats.loss, layout.VAL_ACCEPTANCE_LENGTH: acceptance.acceptance_length}
    metrics.update({f"val/acc_depth_{d}": a for d, a in enumerate(stats.accuracy()) if not math.isnan(a)})
    metrics.update({layout.acceptance_metric(i + 1): r for i, r in enumerate(acceptance.rates())})
    return metrics


def failing_once(batches: Iterator, first_step: int, crash_step: int, marker: Path) -> Iterator:
    """training.crash_once_at_step (fault-injection tests): the batches, but reading the one for crash_step
    raises once per run (a marker file remembers it), as a worker dying mid-run would."""
    for step, batch in enumerate(batches, start=first_step):
        if step == crash_step and not marker.exists():
            marker.write_text(f"crashed at step {step}")
            raise RuntimeError(f"injected failure at step {step} (training.crash_once_at_step)")
        yield batch


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker gets from the driver: plain data (it crosses to the workers as Ray Train's
    train_loop_config, a dict: dataclasses.asdict of this)."""

    config: dict  # the run's PeagleConfig, model_dump(mode="json")
    target_dir: str
    aux_layer_ids: list[int]  # the target layers whose hidden states are the drafter's features
    token_counts: str  # the prepared data's token_counts.safetensors (draft vocabulary)
    tracking_uri: str
    run_id: str  # the MLflow run rank 0 logs to
    storage_path: str  # Ray Train's storage: training.checkpoint_uri or <training.storage_path>
    crash_marker: str  # written by a worker crashed on purpose (training.crash_once_at_step)
    offline_dir: str | None  # the captured shards each rank reads (capture.mode offline); None: Ray Datasets
    feature_scale: list[float] | None  # drafter.normalize_features' per-channel scale
    mask_token: tuple[int, str] | None = None  # P-EAGLE's (id, how chosen): build.mask_token on the driver


@dataclass
class Rank:
    """What one worker holds between steps."""

    cfg: PeagleConfig
    rank: int
    world: int
    device: torch.device
    drafter: torch.nn.Module
    teacher: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator  # COD sampling, different per rank
    state: dict  # step, best AL, and what a standalone export needs (saved in each checkpoint)
    loss_module: torch.nn.Module  # SegmentLoss(drafter), in DDP across the workers (train_step)


def build_rank(plan: WorkerPlan) -> Rank:
    """The drafter (same seed on every rank), its optimizer, and the state of Ray Train's latest checkpoint."""
    import ray.train
    import ray.train.torch

    cfg = PeagleConfig.model_validate(plan.config)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    drafter, teacher, _ = drafter_for_target(
        Path(plan.target_dir),
        cfg.drafter,
        load_file(plan.token_counts)["counts"],
        len(plan.aux_layer_ids),
        torch.Generator().manual_seed(cfg.training.seed),
        init_from=cfg.training.init_from,
        feature_scale=None if plan.feature_scale is None else torch.tensor(plan.feature_scale),
        mask=None if plan.mask_token is None else MaskToken(*plan.mask_token),  # no tokenizer loaded here
    )
    device = ray.train.torch.get_device() if cfg.training.use_gpu else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(cfg.training.cpus_per_worker)  # whatever OMP_NUM_THREADS the process inherited
    drafter, teacher = drafter.to(device), teacher.to(device)
    optimizer, scheduler = make_optimizer(drafter, cfg.training)
    generator = torch.Generator().manual_seed(cfg.training.seed + 1000 * rank)
    state = {
        "step": 0,
        "best_al": -1.0,
        "best_step": None,
        "target_dir": plan.target_dir,
        "aux_layer_ids": plan.aux_layer_ids,
        "num_speculative_tokens": cfg.drafter.num_depths,
        "max_model_len": cfg.target.max_model_len,
    }
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = load_checkpoint(Path(directory), drafter, optimizer, scheduler, generator)
    # Ray Train's DDP (one worker: the module itself). find_unused_parameters: a worker's step without a depth
    # >= 1 element leaves P-EAGLE's mask parameter out; no buffer changes in training (synced once, at start).
    ddp = {"find_unused_parameters": True, "forward_sync_buffers": False}
    loss_module = ray.train.torch.prepare_model(
        SegmentLoss(drafter, cfg.training.loss), move_to_device=False, parallel_strategy_kwargs=ddp
    )
    return Rank(cfg, rank, world, device, drafter, teacher, optimizer, scheduler, generator, state, loss_module)


def rank_records(plan: WorkerPlan, r: Rank) -> tuple[Iterator[Record], list[Record]]:
    """This rank's training records (epoch after epoch) and, on rank 0, the validation records measured.
    Offline, each rank reads its share of the shards itself (no Ray Data executor to feed); online, the
    driver's Ray Datasets."""
    import ray.train

    from peagle_ray.capture.pipeline import read_split, to_record

    epochs, first = r.cfg.training.epochs, r.rank == 0
    records: Iterator[Record]
    if plan.offline_dir:
        shards = Path(plan.offline_dir)
        validation_rows = read_split(shards, "validation") if first else []
        records = (row for _ in range(epochs) for row in read_split(shards, "train", r.rank, r.world))
    else:
        validation_rows = (
            (to_record(row) for row in ray.train.get_dataset_shard("validation").iter_rows()) if first else []
        )
        cache_bytes = int(r.cfg.capture.epoch_cache_gb * 2**30)
        records = cycle_records(ray.train.get_dataset_shard("train"), epochs, cache_bytes)
    return records, validation_subset(validation_rows, r.cfg.training)


def step_metrics(r: Rank, stats: StepStats, speed: dict[str, float]) -> dict[str, float]:
    metrics = {
        "train/loss": stats.loss,
        "train/grad_norm": stats.grad_norm,
        "train/lr": r.scheduler.get_last_lr()[0],
        "train/elements": stats.elements,
        "train/segments": stats.segments,
        "train/workers": r.world,
        **speed,
    }
    accuracy = stats.accuracy()[: r.cfg.drafter.trained_depths]
    metrics.update({f"train/acc_depth_{d}": a for d, a in enumerate(accuracy) if not math.isnan(a)})
    return metrics


def validate_and_checkpoint(r: Rank, step: int, metrics: dict, validation: list[Record], log: MetricLog) -> None:
    """Rank 0 validates; every rank reports the same metrics (checkpoint scoring); rank 0's held metrics are
    written before the checkpoint that covers them, which rank 0 attaches."""
    import ray.train

    seed = r.cfg.training.seed
    val = validate(r.drafter, r.teacher, validation, r.cfg, torch.Generator().manual_seed(seed)) if r.rank == 0 else {}
    val = broadcast_from_rank0(val, r.world)
    log(step, val)
    if val[layout.VAL_ACCEPTANCE_LENGTH] > r.state["best_al"]:
        r.state.update(best_al=val[layout.VAL_ACCEPTANCE_LENGTH], best_step=step)
    log.flush()
    r.state["step"] = step + 1
    with tempfile.TemporaryDirectory() as tmp:
        if r.rank == 0:
            save_checkpoint(Path(tmp), r.drafter, r.optimizer, r.scheduler, r.generator, r.state)
        checkpoint = ray.train.Checkpoint.from_directory(tmp) if r.rank == 0 else None
        ray.train.report({"step": step, **metrics, **val}, checkpoint=checkpoint)


def train_worker(config: dict) -> None:
    """Runs on every Ray Train worker. `config` is the driver's WorkerPlan as a dict (train_loop_config)."""
    plan = WorkerPlan(**config)
    r = build_rank(plan)
    tcfg = r.cfg.training
    records, validation = rank_records(plan, r)
    log = MetricLog(plan.tracking_uri, plan.run_id) if r.rank == 0 else MetricLog(None, None)
    batches = full_batches(records, tcfg.sequences_per_step)
    if tcfg.crash_once_at_step is not None and r.rank == min(1, r.world - 1):
        batches = failing_once(batches, r.state["step"], tcfg.crash_once_at_step, Path(plan.crash_marker))
    wait = DataWait()
    batch = wait.read(batches)
    if r.rank == 0:
        print(f"[train] first batch after {wait.first_s:.1f} s (the data pipeline starting)", flush=True)
    for step in range(r.state["step"], tcfg.max_steps):
        if batch is None:
            break  # data exhausted (epochs done); equal shares end every rank together
        next_batch = wait.read(batches)  # read ahead: the step before the data runs out is a last step too
        started = time.perf_counter()
        stats = train_step(
            r.drafter,
            r.teacher,
            r.optimizer,
            r.scheduler,
            batch,
            r.cfg.drafter,
            tcfg,
            r.generator,
            r.loss_module,
        )
        step_s = time.perf_counter() - started
        wait.trained += step_s
        speed = step_throughput(stats.positions, step_s, r.world, r.device, wait.share)
        metrics = step_metrics(r, all_reduce_stats(stats, r.world), speed)
        if step % tcfg.log_every == 0:
            log(step, metrics)
        batch = next_batch
        if (step + 1) % tcfg.validate_every == 0 or step == tcfg.max_steps - 1 or next_batch is None:
            validate_and_checkpoint(r, step, metrics, validation, log)
