"""The Ray Train job on the tiny target: 2 workers, offline records, a local MLflow server, checkpoints,
resume, recovery from a worker crash, export. Real Ray, real vLLM capture, real MLflow server."""

import itertools
import json
import signal
import time
from contextlib import nullcontext

import pytest
import torch

from peagle_ray.capture.pipeline import read_manifest
from peagle_ray.config import ConfigError, TrainingConfig, build_config
from peagle_ray.serve.app import free_port
from peagle_ray.tracking import MetricLog, local_mlflow_server, metric_progress, run_status
from peagle_ray.train.checkpoint import export_checkpoint
from peagle_ray.train.job import check_inputs, run_training
from peagle_ray.train.worker import validation_subset
from tests.helpers.browser import render_until
from tests.helpers.mlflow_store import mlflow_client
from tests.helpers.train_data import K, config


@pytest.fixture(scope="module")
def workdir(captured_data):
    return captured_data


def history(summary, name):
    return [m.step for m in mlflow_client(summary.tracking_uri).get_metric_history(summary.run_id, name)]


def test_bad_input_fails_before_any_worker_starts(tmp_path, tiny_target):
    cfg = config(tmp_path, tiny_target)
    with pytest.raises(FileNotFoundError, match="has no prepared data; run `peagle-ray data prepare`"):
        check_inputs(cfg)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "summary.json").write_text(json.dumps({"samples": {}}))
    (tmp_path / "data" / "token_counts.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="has no training samples"):
        run_training(cfg)
    (tmp_path / "data" / "summary.json").write_text(json.dumps({"samples": {"train": 5}}))
    with pytest.raises(ConfigError, match=r"has no validation samples .* Raise data.validation_fraction \(now 0.3\)"):
        run_training(cfg)


@pytest.mark.slow
def test_run_status_ends_finished_failed_or_killed(tmp_path):
    client = mlflow_client(f"sqlite:///{tmp_path / 'status.db'}")
    experiment = client.create_experiment("status")
    for raised, status in [(None, "FINISHED"), (RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")]:
        run_id = client.create_run(experiment).info.run_id
        client.set_terminated(run_id, "FINISHED")  # a resumed run shows RUNNING again while it runs
        with pytest.raises(type(raised)) if raised else nullcontext():
            with run_status(client.tracking_uri, run_id):
                assert client.get_run(run_id).info.status == "RUNNING"
                if raised:
                    raise raised
        info = client.get_run(run_id).info
        assert info.status == status and info.end_time is not None


@pytest.mark.slow
def test_a_crashed_benchmarks_results_run_ends_failed(tmp_path):
    from peagle_ray.tracking import results_run

    uri = f"sqlite:///{tmp_path / 'results.db'}"
    cfg = build_config({"training": {"storage_path": str(tmp_path)}})
    with pytest.raises(RuntimeError, match="boom"):
        with results_run(uri, cfg, None, "bench-crash", tmp_path) as run_id:
            assert mlflow_client(uri).get_run(run_id).info.status == "RUNNING"
            raise RuntimeError("boom")
    assert mlflow_client(uri).get_run(run_id).info.status == "FAILED"
    with results_run(uri, cfg, None, "bench-ok", tmp_path) as run_id:
        pass
    assert mlflow_client(uri).get_run(run_id).info.status == "FINISHED"


def test_train_logs_every_metric_checkpoints_resumes_and_exports(workdir, tiny_target):
    handler = signal.getsignal(signal.SIGINT)
    first = run_training(config(workdir, tiny_target, run_name="e2e", max_steps=4))
    assert signal.getsignal(signal.SIGINT) is handler  # Ray Train's Ctrl-C handler does not outlive the run
    metrics = [
        "train/loss",
        *[f"train/acc_depth_{d}" for d in range(K)],
        "val/acceptance_length",
        *[f"val/acceptance_pos_{i}" for i in range(1, K + 1)],
        *[f"val/acc_depth_{d}" for d in range(K)],
    ]
    steps = {name: history(first, name) for name in metrics}
    assert steps["train/loss"] == [0, 1, 2, 3]
    assert all(steps[f"train/acc_depth_{d}"] == [0, 1, 2, 3] for d in range(K))
    assert all(steps[name] == [1, 3] for name in metrics if name.startswith("val/"))
    client = mlflow_client(first.tracking_uri)
    artifacts = {a.path for a in client.list_artifacts(first.run_id)}
    assert {"config.yaml", "provenance.json", "acceptance.png", "drafter"} <= artifacts
    run = client.get_run(first.run_id)
    assert run.data.params["drafter.num_depths"] == str(K)
    assert run.info.status == "FINISHED" and run.info.end_time >= run.info.start_time
    [dataset] = run.inputs.dataset_inputs
    profile = json.loads(dataset.dataset.profile)
    prepared = json.loads((workdir / "data" / "summary.json").read_text())
    assert profile["train_rows"] == prepared["samples"]["train"] > 0 and profile["tokens"] == prepared["tokens"]
    assert profile["bad_rows"] == sum(prepared["bad_rows"].values())
    assert dataset.tags[0].value == "training" and str(workdir / "prompts.txt") in dataset.dataset.source
    assert json.loads((workdir / "train/e2e/export/config.json").read_text())["speculators_model_type"] == "peagle"

    # re-running the same run name resumes at the next step, in the same MLflow run
    second = run_training(config(workdir, tiny_target, run_name="e2e", max_steps=6))
    assert second.run_id == first.run_id
    assert history(second, "train/loss") == [0, 1, 2, 3, 4, 5]
    assert history(second, "val/acceptance_length") == [1, 3, 5]
    assert client.get_run(first.run_id).info.status == "FINISHED"

    exported = export_checkpoint(second.checkpoint, workdir / "standalone-export")
    assert (exported / "model.safetensors").is_file()

    # what a user sees in the MLflow UI (headless Chromium against a server on the same store)
    with local_mlflow_server(workdir, free_port()) as ui:
        page = f"{ui}/#/experiments/{run.info.experiment_id}/runs/{first.run_id}"
        overview = render_until(page, "Finished", dataset.dataset.digest)
        assert "Finished" in overview and dataset.dataset.digest in overview
        charts = render_until(page + "/model-metrics", ">val</div>", ">train</div>", "js-plotly-plot")
        assert ">val</div>" in charts and ">train</div>" in charts  # the metric sections
        assert "js-plotly-plot" in charts  # and charts drawn (those below the fold only once scrolled to)


def test_a_worker_crash_is_recovered_without_metric_gaps_or_duplicates(workdir, tiny_target):
    summary = run_training(
        config(
            workdir,
            tiny_target,
            run_name="crash",
            max_steps=6,
            crash_once_at_step=3,
            max_failures=1,
            validation_records=1,
            checkpoint_uri=f"file://{workdir}/object-store",  # resumed from there (pyarrow.fs)
        )
    )
    assert (workdir / "train" / "crash.crashed").read_text() == "crashed at step 3"
    assert list((workdir / "object-store" / "crash").glob("checkpoint_*/state.json"))
    assert not list((workdir / "train" / "crash").glob("checkpoint_*"))
    assert history(summary, "train/loss") == [0, 1, 2, 3, 4, 5]
    assert history(summary, "val/acceptance_length") == [1, 3, 5]


def test_a_run_that_fails_ends_failed_in_mlflow(workdir, tiny_target):
    cfg = config(workdir, tiny_target, run_name="fails", max_steps=4, crash_once_at_step=1, max_failures=0)
    with pytest.raises(Exception, match="injected failure at step 1"):
        run_training(cfg)
    client = mlflow_client(cfg.tracking.tracking_uri)
    [run] = client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment).experiment_id],
        filter_string="tags.`peagle.run_name` = 'fails'",
    )
    assert run.info.status == "FAILED" and run.info.end_time is not None


def test_the_step_where_the_data_runs_out_is_validated_and_checkpointed(workdir, tiny_target):
    # 2 workers, 1 sequence a step, 1 epoch: the data ends long before max_steps, on a step that is not a
    # validate_every step; its metrics and checkpoint must not be lost (only validate_every steps flushed them)
    splits = [s for shard in read_manifest(workdir / "hidden")["shards"] for s in shard["splits"]]
    steps = splits.count("train") // 2
    assert steps % 3 != 0  # the last step is not a validation step by itself
    summary = run_training(config(workdir, tiny_target, run_name="epoch-end", max_steps=50, epochs=1, validate_every=3))
    assert history(summary, "train/loss") == list(range(steps))
    assert history(summary, "val/acceptance_length") == [*range(2, steps - 1, 3), steps - 1]
    states = [
        json.loads(p.read_text())["step"] for p in (workdir / "train" / "epoch-end").glob("checkpoint_*/state.json")
    ]
    assert max(states) == steps  # the checkpoint after the last step: a resumed run starts past the data's end


def test_validation_measures_the_first_records_by_sample_id():
    rows = [{"sample_id": s} for s in ["c", "a", "d", "b"]]  # the read order of Ray Data is not fixed
    assert [r["sample_id"] for r in validation_subset(rows, TrainingConfig(validation_records=2))] == ["a", "b"]
    assert [r["sample_id"] for r in validation_subset(rows, TrainingConfig())] == ["a", "b", "c", "d"]
    mixed = [{"sample_id": s} for s in ["sharegpt-1", "traffic:r2:0", "sharegpt-0", "traffic:r1:0"]]
    only = TrainingConfig(validation_prefix="traffic:")  # adapt's curve: the workload, not the replay
    assert [r["sample_id"] for r in validation_subset(mixed, only)] == ["traffic:r1:0", "traffic:r2:0"]


class CountingShard:
    """A dataset shard stand-in: iter_rows counts how often the records are streamed (captured, online)."""

    def __init__(self, rows):
        self.rows, self.streams = rows, 0

    def iter_rows(self):
        self.streams += 1
        yield from self.rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_later_epochs_replay_the_first_instead_of_capturing_again(capsys, dtype):
    import numpy as np

    from peagle_ray.capture.pipeline import as_array
    from peagle_ray.train.worker import cycle_records

    def row(i: int, error: str = "") -> dict:  # as capture's Ray Data rows come (numpy, an error column)
        n = 0 if error else i + 3
        return {
            "sample_id": f"s{i}",
            "split": "train",
            "input_ids": np.arange(i + 3),
            "loss_mask": np.ones(i + 3, np.int8),
            "aux_hidden": as_array(torch.full((n, 4), i + 0.5, dtype=dtype)),  # the target's dtype on the wire
            "last_hidden": as_array(torch.full((n, 2), -i - 0.25, dtype=dtype)),
            "hidden_dtype": str(dtype).removeprefix("torch."),
            "error": error,
        }

    rows = [row(0), row(1), row(2, "non_finite"), row(3), row(4), row(5)]
    good = [r for r in rows if not r["error"]]
    for limit, streams in ((1 << 20, 1), (200, 3), (0, 3)):  # cached / first epoch outgrows the cache / off
        shard = CountingShard(rows)
        out = list(cycle_records(shard, 3, limit))
        assert shard.streams == streams and len(out) == 15, limit  # the error row skipped in every epoch
        for got, want in zip(out, good * 3, strict=True):
            assert got["sample_id"] == want["sample_id"] and got["split"] == "train"
            assert torch.equal(got["input_ids"], torch.from_numpy(want["input_ids"]))
            i = int(want["sample_id"][1:])
            assert torch.equal(got["aux_hidden"], torch.full((i + 3, 4), i + 0.5, dtype=dtype))
            assert torch.equal(got["last_hidden"], torch.full((i + 3, 2), -i - 0.25, dtype=dtype))
            assert got["loss_mask"].dtype == torch.int8
    assert "epoch 0: capture bad rows: 1 skipped (non_finite 1)" in capsys.readouterr().out
    from peagle_ray.capture.pipeline import to_record, to_row

    for want in good:  # a record made a row again (online validation's dataset) reads back the same
        again = to_record(to_row(to_record(want)))
        assert again["aux_hidden"].dtype == dtype and torch.equal(again["aux_hidden"], to_record(want)["aux_hidden"])
    shard = CountingShard(rows)
    assert len(list(itertools.islice(cycle_records(shard, 3, 1 << 20), 7))) == 7 and shard.streams == 1


@pytest.mark.slow
def test_local_mlflow_server_starts_answers_and_stops(tmp_path):
    import urllib.request

    port = free_port()
    with local_mlflow_server(tmp_path, port) as uri:
        with urllib.request.urlopen(f"{uri}/health", timeout=5) as response:
            assert response.status == 200
        experiment = mlflow_client(uri).create_experiment("probe")
        assert mlflow_client(uri).get_experiment(experiment).name == "probe"
    assert (tmp_path / "mlflow.db").is_file()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{uri}/health", timeout=2)


def test_online_mode_trains_while_the_target_captures(workdir, tiny_target, tmp_path):
    cfg = config(workdir, tiny_target, run_name="online", max_steps=4)
    cfg.capture.mode = "online"
    cfg.capture.output_dir = str(tmp_path / "never-written")
    summary = run_training(cfg)
    assert history(summary, "train/loss") == [0, 1, 2, 3]
    assert history(summary, "val/acceptance_length") == [1, 3]
    assert not (tmp_path / "never-written").exists()  # online: records are streamed, nothing stays on disk


@pytest.mark.slow
def test_driver_progress_follows_the_runs_mlflow_metrics(tmp_path):
    client = mlflow_client(f"sqlite:///{tmp_path / 'progress.db'}")
    run_id = client.create_run(client.create_experiment("progress")).info.run_id
    client.log_metric(run_id, "val/acceptance_length", 1.1, step=49)

    def polled_until(bar, n: int):
        deadline = time.time() + 10
        while bar.n != n and time.time() < deadline:
            time.sleep(0.05)
        return bar

    with metric_progress(client.tracking_uri, run_id, total=200, desc="train", every_s=0.05) as bar:
        assert bar.n == 50  # read at the start (a resumed run starts where its metrics end)
        client.log_metric(run_id, "val/acceptance_length", 1.25, step=99)
        assert polled_until(bar, 100).n == 100 and "val AL 1.250" in str(bar)
        client.log_metric(run_id, "progress/steps_done", 130, step=129)  # between checkpoints: the live count
        assert polled_until(bar, 130).n == 130 and "val AL 1.250" in str(bar)
        client.log_metric(run_id, "val/acceptance_length", 1.3, step=199)
    assert bar.n == 200  # the last reading is taken on the way out


@pytest.mark.slow
def test_rank0_writes_its_step_count_as_it_goes_and_holds_the_rest_to_the_checkpoint(tmp_path):
    client = mlflow_client(f"sqlite:///{tmp_path / 'log.db'}")
    run_id = client.create_run(client.create_experiment("log")).info.run_id
    log = MetricLog(client.tracking_uri, run_id, progress_every_s=3600)
    for step in range(3):
        log(step, {"train/loss": 5.0 - step})
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "progress/steps_done")] == [(0, 1.0)]
    assert client.get_metric_history(run_id, "train/loss") == []  # held until the checkpoint
    log.flush()
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [0, 1, 2]
    every_step = MetricLog(client.tracking_uri, run_id, progress_every_s=0)
    every_step(3, {"train/loss": 2.0})
    every_step(4, {"train/loss": 1.5})
    assert [m.value for m in client.get_metric_history(run_id, "progress/steps_done")] == [1.0, 4.0, 5.0]


def test_data_wait_counts_the_waits_after_the_first_batch(monkeypatch):
    from peagle_ray.train import worker

    clock = iter([0.0, 5.0, 10.0, 10.5, 20.0, 22.0])  # perf_counter before/after each of three reads
    monkeypatch.setattr(worker.time, "perf_counter", lambda: next(clock))
    wait, batches = worker.DataWait(), iter(["a", "b"])
    assert wait.read(batches) == "a" and wait.first_s == 5.0 and wait.waited == 0.0  # the pipeline starting
    wait.trained += 4.5
    assert wait.read(batches) == "b" and wait.waited == 0.5
    wait.trained += 3.0
    assert wait.read(batches) is None and wait.waited == 2.5  # waiting for an end is waiting too
    assert wait.share == 2.5 / (2.5 + 7.5)
