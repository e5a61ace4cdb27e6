import json
import subprocess
import sys

import pytest

from peagle_ray.cli import SUBCOMMANDS, main

EXPECTED = ["target", "data", "train", "export", "eval", "serve", "adapt", "demo", "bench"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The installed console script, as a user runs it."""
    exe = [sys.executable, "-m", "peagle_ray.cli"]
    return subprocess.run([*exe, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # the console script in a subprocess
def test_help_lists_every_subcommand():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in EXPECTED:
        assert f"    {name} " in result.stdout, name
    assert sorted(SUBCOMMANDS) == sorted(EXPECTED)


def test_bench_e2e_without_any_drafter_fails_clearly(tmp_path, capsys):
    assert main(["bench", "e2e", "--set", f"training.storage_path={tmp_path}"]) == 2
    assert "no drafter to benchmark" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_mask_writes_json(tmp_path):
    out = tmp_path / "mask.json"
    args = ["--max-positions", "64", "96", "--depths", "3", "4", "--steps", "2", "--draft-vocab-size", "128"]
    result = run_cli("bench", "mask", *args, "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["max_positions"], r["depths"], r["table_mb"]) for r in rows] == [(64, 3, 0.0), (96, 4, 0.1)]
    assert all(r["rebuilt_ms_per_step"] > 0 and r["table_gather_ms_per_step"] > 0 and r["step_s"] > 0 for r in rows)
    assert all(0 < r["mask_share_of_step"] < 1 for r in rows)


@pytest.mark.slow
def test_bench_draft_latency_writes_json(tmp_path, tiny_target):
    out = tmp_path / "latency.json"
    result = run_cli(
        "bench",
        "draft-latency",
        "--target",
        str(tiny_target),
        "--draft-vocab-size",
        "0",
        "--max-k",
        "3",
        "--repeats",
        "3",
        "--context",
        "16",
        "--num-layers",
        "2",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["hidden_size"] == 96 and data["layers"] == 2
    assert set(data["ms"]) == {"peagle", "eagle3"} and list(data["ms"]["peagle"]) == ["1", "2", "3"]


def test_bad_config_exits_2_naming_the_field(capsys):
    assert main(["demo", "--set", "drafter.num_depths=0"]) == 2
    assert "drafter.num_depths: Input should be greater than or equal to 1; got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_target_info_reads_the_tiny_target(tiny_target):
    result = run_cli("target", "info", str(tiny_target))
    assert result.returncode == 0, result.stderr
    assert "llama, 6 layers, hidden 96" in result.stdout
    assert "default aux layers [2, 3, 5]" in result.stdout


@pytest.mark.slow
def test_target_info_on_a_non_model_dir_fails_clearly(tmp_path):
    result = run_cli("target", "info", str(tmp_path))
    assert result.returncode != 0
    assert "must be an HF model directory with a config.json" in result.stderr


def test_every_benchmark_option_is_a_parameter_of_its_function_and_help_shows_its_default(capsys):
    """The command table and the benchmark functions agree: each option given reaches a parameter, and the
    defaults shown in `bench KIND --help` are the function's own (its signature, imported)."""
    import importlib
    import inspect

    from peagle_ray.cli import BENCHES, build_parser

    parser = build_parser()
    for kind, bench in BENCHES.items():
        function = getattr(importlib.import_module(f"peagle_ray.bench.{bench.module}"), bench.function)
        params = inspect.signature(function).parameters
        assert set(bench.options) | set(bench.needs) <= set(params), kind
        assert parser.parse_args(["bench", kind]).kind == kind
        with pytest.raises(SystemExit):
            build_parser(kind).parse_args(["bench", kind, "--help"])
        shown = " ".join(capsys.readouterr().out.split())
        for dest in bench.options:
            default = params[dest].default
            if isinstance(default, int | float | tuple) and default is not None:
                assert f"default: {default}" in shown, (kind, dest, default)


@pytest.mark.slow  # a fresh interpreter importing Ray Data
def test_ray_data_info_lines_stay_off_the_console():
    """Ray Data logs progress at INFO every 10 s when stdout is not a terminal; importing peagle_ray first
    points RAY_DATA_LOGGING_CONFIG at ours: warnings still reach the console, INFO lines only the log file."""
    probe = (
        "import logging, peagle_ray, ray.data; "
        "logging.getLogger('ray.data._internal.progress.logging_progress').info('probe-info'); "
        "logging.getLogger('ray.data').warning('probe-warning')"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "RAY_DATA_LOGGING_CONFIG"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console
    assert "probe-warning" in console and "probe-info" not in console


@pytest.mark.ray
def test_ray_and_serve_info_lines_stay_off_the_console(tmp_path):
    """Joining or starting Ray through ensure_ray keeps Ray's and Serve's INFO lines ("Started a local Ray
    instance", "Application ... is ready") off the console; their warnings still reach it."""
    probe = (
        "import logging, ray; from peagle_ray.cluster import ensure_ray; ensure_ray(); "
        "logging.getLogger('ray.serve').info('probe-info'); logging.getLogger('ray.serve').warning('probe-warning'); "
        "logging.getLogger('ray').info('probe-ray-info'); ray.shutdown()"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console
    assert "probe-warning" in console and "probe-info" not in console and "probe-ray-info" not in console
    assert "INFO" not in console, console
