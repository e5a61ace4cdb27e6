"""The capture stage behind `peagle-ray data capture` (jobs/capture.py), and the one target session that
`data prepare|capture` share: the target is started in Ray Serve for the run and stopped afterwards (also on
errors and Ctrl-C); data preparation (peagle_ray/data/run.py) borrows its handle to regenerate answers.

    prepare_and_capture(cfg, prepare, capture) -> DataArtifacts(prepared: PreparedData, captured: CaptureSummary)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from peagle_ray.capture.pipeline import capture_dataset, done_sample_ids, iter_records, write_offline
from peagle_ray.capture.target_server import start_target_server, stop_target_server
from peagle_ray.cluster import ensure_ray
from peagle_ray.config import PeagleConfig
from peagle_ray.data import run as data_stage
from peagle_ray.data.prepare import BadRows, PreparedData, TokenizedSample
from peagle_ray.data.sources import check_sources
from peagle_ray.target import TargetInfo, drafter_target

CAPTURE_SUMMARY = "capture_summary.json"


@dataclass
class TargetSession:
    handle: object  # Serve handle of TargetServer
    info: TargetInfo
    num_layers_captured: int  # aux layers + the last layer


@contextmanager
def target_session(cfg: PeagleConfig) -> Iterator[TargetSession]:
    info = drafter_target(cfg)  # refused here, before the engine starts, when no drafter can be trained for it
    ensure_ray()
    print(f"[capture] starting the target in Ray Serve: {info.path} (first start takes ~30-60 s on CPU)")
    handle = start_target_server(cfg, info.path, info.num_layers)
    aux = info.aux_layer_ids(cfg.capture.aux_layer_ids)
    try:
        yield TargetSession(handle, info, len(aux) + 1)
    finally:
        stop_target_server()


def prepared_samples(cfg: PeagleConfig) -> list[TokenizedSample]:
    return PreparedData.read(cfg.data.output_dir).all_records()


def samples_to_capture(cfg: PeagleConfig) -> tuple[list, set]:
    """(prepared samples not yet in capture.output_dir, sample ids already there)."""
    done = done_sample_ids(Path(cfg.capture.output_dir))
    return [s for s in prepared_samples(cfg) if s.sample_id not in done], done


@dataclass(frozen=True)
class CaptureSummary:
    """The capture stage's artifact for offline capture: capture.output_dir's shards (listed in its manifest,
    pipeline.read_manifest) and capture_summary.json, this object's fields but the directory."""

    directory: Path
    captured: int  # records written by this run
    skipped_done: int  # samples already in the directory (a rerun captures only the rest)
    bad_rows: dict[str, int]
    seconds: float

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "directory"}


def run_capture_offline(cfg: PeagleConfig, session: TargetSession) -> CaptureSummary:
    """Capture every prepared sample not yet in capture.output_dir into safetensors shards."""
    out = Path(cfg.capture.output_dir)
    todo, done = samples_to_capture(cfg)
    print(f"[capture] {len(todo)} samples to capture ({len(done)} already in {out})")
    bad, start, written = BadRows(), time.monotonic(), 0
    if todo:
        ds = capture_dataset(
            todo, session.num_layers_captured, session.info.hidden_size, cfg.capture.batch_size, cfg.capture.num_actors
        )
        written = write_offline(iter_records(ds.iter_rows(), bad, total=len(todo)), out, cfg.capture.shard_size)
    result = CaptureSummary(out, written, len(done), dict(bad.counts), round(time.monotonic() - start, 1))
    out.mkdir(parents=True, exist_ok=True)
    (out / CAPTURE_SUMMARY).write_text(json.dumps(result.summary(), indent=2))
    print(f"[capture] {written} records written to {out}; {bad.report()}")
    return result


def prepare_and_capture(cfg: PeagleConfig, prepare: bool, capture: bool) -> DataArtifacts:
    """`peagle-ray data capture`: the target's hidden states for the prepared data, captured through a Ray
    Serve-hosted vLLM engine and Ray Data.

    Writes safetensors shards + manifest to capture.output_dir (reruns skip done samples). With `prepare` (--prepare), `data prepare` runs first in the same target session.
    Online capture (capture.mode) streams straight into `peagle-ray train` instead."""
    if prepare:
        check_sources(cfg.data.sources)  # before the target starts
    if prepare and not (capture or data_stage.needs_target(cfg)):
        return DataArtifacts(prepared=data_stage.run(cfg))
    with target_session(cfg) as session:
        prepared = data_stage.run(cfg, session.handle) if prepare else None
        captured = run_capture_offline(cfg, session) if capture else None
    return DataArtifacts(prepared, captured)


@dataclass(frozen=True)
class DataArtifacts:
    """What `peagle-ray data prepare|capture` made: the stages that ran have their artifact."""

    prepared: PreparedData | None = None
    captured: CaptureSummary | None = None

    def summary(self) -> dict:
        """The command's JSON: {"prepare": summary.json, "capture": capture_summary.json} for the stages run."""
        out = {}
        if self.prepared is not None:
            out["prepare"] = self.prepared.summary()
        if self.captured is not None:
            out["capture"] = self.captured.summary()
        return out
