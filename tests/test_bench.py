"""Benchmarks on tiny sizes: training memory (its configurations in subprocesses), Ray Train workers, capture."""

import pytest

from peagle_ray.bench import train_memory


@pytest.mark.slow
def test_train_memory_reports_every_configuration():
    result = train_memory.run(
        seq_lens=(48,), depths=(3,), segment_length=40, draft_vocab_size=256, progress=lambda _line: None
    )
    rows, reference = result["rows"][:2], result["rows"][2]  # speculators is installed by scripts/setup.sh
    assert [(r["seq_len"], r["depths"], r["partitioned"]) for r in rows] == [(48, 3, True), (48, 3, False)]
    assert all("error" not in r for r in rows), rows
    assert rows[0]["segments"] >= 2 and rows[1]["segments"] == 1
    assert rows[0]["elements"] == rows[1]["elements"]  # same seeded COD sampling
    assert all(r["peak_rss_mb"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    # the reference trainer's step on the same shape, re-run in this run
    assert reference["trainer"] == "reference" and "error" not in reference, reference
    assert reference["tokens_per_s"] > 0 and reference["trained_elements"] > 0
    assert rows[0]["vs_reference"]["tokens_per_s"] == round(rows[0]["tokens_per_s"] / reference["tokens_per_s"], 3)
    fast = train_memory.run(
        seq_lens=(48,),
        depths=(3,),
        segment_length=40,
        draft_vocab_size=256,
        progress=lambda _line: None,
        freeze_lm_head=True,
        bf16=True,
        reference=False,
    )
    assert fast["precision"] == "bfloat16" and fast["freeze_lm_head"] and all("error" not in r for r in fast["rows"])
    assert [r["elements"] for r in fast["rows"]] == [r["elements"] for r in rows]


def test_bench_train_measures_one_and_two_workers(tiny_target, ray_local):
    """The real Ray Train job (tiny target, synthetic records) reports tokens/s and peak memory per worker."""
    from peagle_ray.bench import train
    from peagle_ray.config import build_config

    cfg = build_config({"target": {"path": str(tiny_target)}, "drafter": {"num_depths": 3, "draft_vocab_size": 64}})
    result = train.run(cfg, workers=(1, 2), steps=2, seq_len=48, progress=lambda _line: None)
    assert [r["workers"] for r in result["results"]] == [1, 2]
    for row in result["results"]:
        assert row["tokens_per_s"] > 0 and row["peak_memory_mb_per_worker"] > 100 and row["cpus_per_worker"] >= 1, row
    assert result["two_worker_speedup"] > 0


def test_bench_capture_measures_the_pipeline_beside_plain_prefill(tiny_target, ray_local):
    """bench capture in this worker's cluster: plain prefill in its own engine, then one timed pass of the
    capture pipeline through one Serve-hosted target replica, with where its time went. (Replicas spread over
    nodes are test_multinode.py's capture job: bench capture places them by the same code.)"""
    from peagle_ray.bench import capture
    from peagle_ray.config import build_config
    from peagle_ray.serve.app import free_port

    cfg = build_config(
        {
            "target": {"path": str(tiny_target), "max_model_len": 256, "kv_cache_gib": 1},
            "capture": {"batch_size": 4},
            "serving": {"port": free_port()},  # Serve's HTTP proxy: not 8000, which the other worker may hold
        }
    )
    result = capture.run(cfg, num_sequences=16, seq_len=64, replicas=(1,), repeats=1)
    print("bench capture:", result["by_replicas"], "prefill tok/s", result["prefill_tokens_per_s"])
    [row] = result["by_replicas"]
    assert row["replicas"] == 1 and len(row["passes_tokens_per_s"]) == 1  # repeats=1
    assert row["tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0 and not result["bad_rows"]
    # (both rates are rounded as written: the ratio, from the unrounded ones, within its last digit)
    assert result["capture_over_prefill"] == pytest.approx(
        row["tokens_per_s"] / result["prefill_tokens_per_s"], abs=1e-3
    )
    assert row["per_request_ms"]["engine"] > 0 and row["first_record_s"] > 0  # where the time went
    assert row["wire_bytes_per_token"] == 4 * 96 * 4  # 3 aux layers + the last, H 96, float32: no upcast
    assert result["bytes_per_token_offline"] > 0
