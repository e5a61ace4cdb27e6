import json
import subprocess
import sys

import pytest

from peagle_ray.cli import COMMAND_NAMES, main

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
    assert COMMAND_NAMES == EXPECTED


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


def test_every_benchmark_has_help_and_its_options_come_from_its_signature(capsys):
    """Each benchmark's options are declared once, in its function's signature (options.Opt): `bench KIND
    --help` lists every one with the function's own default, and its module docstring is the help."""
    import inspect

    from peagle_ray.cli import BENCHES, bench_options, build_parser

    parser = build_parser()
    for kind, bench in BENCHES.items():
        assert bench.help and not bench.help.startswith("`peagle-ray"), kind
        assert parser.parse_args(["bench", kind]).kind == kind
        with pytest.raises(SystemExit):
            build_parser(kind).parse_args(["bench", kind, "--help"])
        shown = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps after hyphens
        options = bench_options(bench.load())
        assert options, kind  # every benchmark has options
        params = inspect.signature(bench.load()).parameters
        for name, opt, _, default in options:
            assert name in params and opt.help.split()[0] in shown, (kind, name)
            if isinstance(default, tuple):
                assert f"default: {' '.join(map(str, default))})" in shown, (kind, name, default)
            elif isinstance(default, int | float) and not isinstance(default, bool):
                assert f"default: {default})" in shown, (kind, name, default)


def test_benchmark_options_parse_to_their_parameters_types():
    from peagle_ray.cli import build_parser

    args = build_parser("mask").parse_args(["bench", "mask", "--max-positions", "64", "128", "--steps", "2"])
    assert args.max_positions == [64, 128] and args.steps == 2 and args.draft_vocab_size is None
    args = build_parser("capture").parse_args(["bench", "capture", "--sequences", "4", "--replicas", "1", "2"])
    assert args.num_sequences == 4 and args.replicas == [1, 2]
    args = build_parser("train-memory").parse_args(["bench", "train-memory", "--bf16", "--memory-limit-gb", "2.5"])
    assert args.bf16 is True and args.memory_limit_gb == 2.5 and args.freeze_lm_head is None
    args = build_parser("ablation").parse_args(["bench", "ablation", "--variant", "base", "--variant", "x", "a.b=1"])
    assert args.variants == [["base"], ["x", "a.b=1"]]
    with pytest.raises(SystemExit):  # choices from the signature
        build_parser("peers").parse_args(["bench", "peers", "--algorithms", "medusa"])
    args = build_parser("e2e").parse_args(["bench", "e2e", "--k", "2", "3", "--peagle", "d", "--suite", "humaneval"])
    assert args.k_values == [2, 3] and str(args.peagle) == "d" and args.suite == "humaneval"


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
