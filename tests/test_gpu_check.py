"""scripts/gpu_check.sh cannot rot between lent GPUs: the same script rehearsed on the CPU at the tiny shape
(its gpu tests skip without CUDA; the step table runs ours with SDPA and the reference trainer)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_gpu_check_rehearses_on_the_cpu(tmp_path):
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_CHECK_SHAPES": "tiny",
        "GPU_CHECK_SEQ_LENS": "64 256",
        "GPU_CHECK_SEGMENT": "128",
    }
    out = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "cpu (rehearsal)" in (tmp_path / "env.txt").read_text()
    assert "skipped" in (tmp_path / "gpu_tests.txt").read_text()  # the gpu tier, collected and skipped
    table = json.loads((tmp_path / "step_table.json").read_text())
    rows = {(r["trainer"], r["seq_len"]): r for r in table["rows"]}
    assert set(rows) == {(trainer, n) for trainer in ("ours", "reference") for n in (64, 256)}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["peak_gib"] > 0, row
    assert rows[("ours", 256)]["segments"] > 1 and rows[("ours", 256)]["estimate_gib"] > 0  # partitioned
    assert all(row["spread_pct"] >= 0 and row["step_s"] > 0 for row in rows.values())
    text = (tmp_path / "step_table.md").read_text()
    assert "| tiny | 256 | ours | sdpa |" in text and "| GPU busy |" in text
    assert "tiny N=256: ours (sdpa) / reference: " in text  # the ratios the goals are judged by
    syncs = {r["algorithm"]: r for r in json.loads((tmp_path / "host_syncs.json").read_text())["rows"]}
    assert syncs["peagle"]["reads_per_step"] == 1 and syncs["peagle"]["copies_in_per_step"] == 2, syncs
    assert "'reads_per_step': 1" in out.stdout  # printed where the GPU run's output shows it


def test_the_step_profiler_rehearses_on_the_cpu(tmp_path):
    """scripts/gpu_profile_step.py (one step under torch.profiler, for a lent GPU) at the tiny shape on the CPU."""
    out = subprocess.run(
        [sys.executable, "scripts/gpu_profile_step.py", "--shape", "tiny", "--seq-len", "64", "--segment-length",
         "128", "--attention", "sdpa", "--out", str(tmp_path)],  # fmt: skip
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = (tmp_path / "profile_sdpa.txt").read_text()
    assert text.startswith("tiny N=64 sdpa: step ") and "aten::mm" in text
