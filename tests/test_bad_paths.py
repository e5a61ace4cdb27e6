"""A path that cannot work fails at once, before Ray, a target or a worker starts, naming the setting, the
path and what was expected (exit status 2, no traceback)."""

import shutil
import subprocess
import sys
import time

import pytest

from peagle_ray.config import ConfigError
from peagle_ray.target import check_target_dir


def cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "peagle_ray.cli", *args], capture_output=True, text=True, timeout=120
    )
    return result, time.monotonic() - started


def broken_targets(tmp_path, tiny_target) -> list[tuple[str, type, str]]:
    """(target.path, error, words): every way a target directory can be unusable."""
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "empty").mkdir()
    shutil.copytree(tiny_target, tmp_path / "bad-json")
    (tmp_path / "bad-json" / "config.json").write_text("{not json")
    shutil.copytree(tiny_target, tmp_path / "no-weights")
    for weights in (tmp_path / "no-weights").glob("*.safetensors"):
        weights.unlink()
    shutil.copytree(tiny_target, tmp_path / "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "no-tokenizer" / name).unlink(missing_ok=True)
    return [
        (str(tmp_path / "missing"), FileNotFoundError, "does not exist; expected an HF model directory"),
        (str(tmp_path / "file"), NotADirectoryError, "is a file, not a directory"),
        (str(tmp_path / "empty"), FileNotFoundError, "has no config.json"),
        (str(tmp_path / "bad-json"), ConfigError, "config.json cannot be read"),
        (str(tmp_path / "no-weights"), FileNotFoundError, r"holds no \*\.safetensors weights"),
        (str(tmp_path / "no-tokenizer"), FileNotFoundError, "has no tokenizer"),
    ]


def test_every_unusable_target_directory_is_named(tmp_path, tiny_target):
    from pathlib import Path

    assert check_target_dir(Path(tiny_target)) == Path(tiny_target)
    for path, error, words in broken_targets(tmp_path, tiny_target):
        with pytest.raises(error, match=words):
            check_target_dir(Path(path))


@pytest.mark.slow
def test_data_prepare_with_a_missing_target_fails_naming_target_path(tmp_path):
    result, _ = cli(
        "data",
        "prepare",
        "--set",
        f"target.path={tmp_path / 'nowhere'}",
        "--set",
        "data.regenerate=false",
        "--set",
        f"data.output_dir={tmp_path / 'out'}",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"target.path {tmp_path / 'nowhere'} does not exist" in result.stderr


@pytest.mark.slow
def test_serve_with_a_drafter_without_config_fails_before_ray_starts(tmp_path, tiny_target):
    (tmp_path / "drafter").mkdir()
    result, seconds = cli("serve", "--drafter", str(tmp_path / "drafter"), "--set", f"target.path={tiny_target}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"drafter {tmp_path / 'drafter'} has no config.json; expected a drafter exported by" in result.stderr
    assert "Started a local Ray instance" not in result.stderr + result.stdout
