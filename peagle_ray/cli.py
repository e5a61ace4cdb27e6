"""`peagle-ray`: the command line. Each subcommand parses, builds the config, and makes one library call; its
help is that function's docstring (COMMANDS), a benchmark's options its signature (options.py).

peagle-ray target prepare            # embedded SmolLM2 -> HF directory in the cache, verified
peagle-ray demo                      # the main job on the embedded default
peagle-ray <cmd> --config FILE --set section.field=value ...
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from peagle_ray import stopping
from peagle_ray.cluster import leave_cluster, ray_running
from peagle_ray.config import CACHE_ENV, ConfigError, PeagleConfig, load_config
from peagle_ray.options import arg, bench_needs, bench_options, docstring, module_source, option_arg, summary

RAW = argparse.RawDescriptionHelpFormatter  # a command's --help shows its docstring as written

GROUPS = {  # commands with actions; every other command's help is the docstring of the function it calls
    "target": "Prepare the embedded SmolLM2 target (or inspect a target directory).",
    "data": "Prepare conversations and capture the target's hidden states for them.",
    "bench": "Benchmarks that write JSON (draft latency, training memory, masks, capture, e2e, load, ...).",
}


def _cmd_target_prepare(args: argparse.Namespace) -> None:
    from peagle_ray.target import prepare_embedded_target

    cfg = _config(args)
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else cfg.cache_path()
    print(prepare_embedded_target(cache, force=args.force))


def _cmd_target_info(args: argparse.Namespace) -> None:
    from peagle_ray.target import read_target_info

    print(read_target_info(args.path))


def _cmd_data(args: argparse.Namespace) -> None:
    from peagle_ray.capture.run import prepare_and_capture

    prepare = args.action == "prepare" or getattr(args, "prepare", False)
    made = prepare_and_capture(_config(args), prepare=prepare, capture=args.action == "capture")
    print(json.dumps(made.summary(), indent=2))


def _cmd_train(args: argparse.Namespace) -> None:
    if args.dry_run:
        from peagle_ray.train.plan import plan_training

        plan = plan_training(_config(args), args.target_config)
        print(plan.render(args.gpu_memory_gib))
        return
    from peagle_ray.train.job import run_training

    print(json.dumps(asdict(run_training(_config(args))), indent=2))


def _cmd_export(args: argparse.Namespace) -> None:
    from peagle_ray.train.checkpoint import export_checkpoint

    print(export_checkpoint(args.checkpoint, args.out, args.num_speculative_tokens))


def _cmd_eval(args: argparse.Namespace) -> None:
    from peagle_ray.eval.sweep import evaluate

    cfg = _config(args)
    outcome = evaluate(cfg, _drafters(cfg, args, "evaluate"), args.k)
    _write_json(outcome.results.to_json(), args.json)
    print(outcome.table, file=sys.stderr)
    print(f"[eval] {outcome.json}; MLflow runs {outcome.runs} at {outcome.tracking_uri}", file=sys.stderr)


def _cmd_serve(args: argparse.Namespace) -> None:
    from peagle_ray.serve.app import serve_forever
    from peagle_ray.serve.registry import chosen_drafter

    cfg = _config(args)
    drafter = chosen_drafter(cfg, args.drafter, args.no_drafter)
    if args.adapt_every is not None:
        from peagle_ray.adapt import serve_adapting

        serve_adapting(cfg, drafter, args.num_speculative_tokens, args.adapt_every)
    else:
        serve_forever(cfg, drafter, args.num_speculative_tokens, args.detach)


def _cmd_adapt(args: argparse.Namespace) -> None:
    from peagle_ray.adapt import run_adapt

    report = run_adapt(_config(args))
    _write_json(report.to_json(), args.json)


def _cmd_demo(args: argparse.Namespace) -> None:
    from peagle_ray.demo import run_demo

    run_demo(_config(args), scale=args.scale, wait=not args.no_wait)


def _cmd_bench(args: argparse.Namespace) -> None:
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


def _config(args: argparse.Namespace) -> PeagleConfig:
    overrides = list(args.overrides)
    if getattr(args, "suite", None):
        overrides.append(f"eval.suite={args.suite}")
    return load_config(args.config, overrides)


def _drafters(cfg: PeagleConfig, args: argparse.Namespace, purpose: str) -> dict[str, Path]:
    from peagle_ray.eval.sweep import choose_drafters

    return choose_drafters(cfg, {a: getattr(args, a, None) for a in ("peagle", "eagle3")}, purpose)


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
    """One `peagle-ray <group> [<action>]`: the library function it calls ("module:function", whose docstring
    is its help: first paragraph in the list, all of it on its own --help page), the CLI function that calls
    it, and its options."""

    name: str  # "train", or "data prepare" (group and action)
    calls: str
    run: Callable[[argparse.Namespace], None]  # raises on failure (main turns errors into exit statuses)
    args: tuple = ()
    config: bool = True  # --config / --set


COMMANDS = [
    Command(
        "target prepare",
        "peagle_ray.target:prepare_embedded_target",
        _cmd_target_prepare,
        (
            arg("--cache-dir", help=f"Cache directory (default: ${CACHE_ENV} or ~/.cache/peagle-ray)."),
            arg("--force", action="store_true", help="Convert again even if the cache is valid."),
        ),
    ),
    Command(
        "target info",
        "peagle_ray.target:read_target_info",
        _cmd_target_info,
        (arg("path", type=Path, help="HF model directory."),),
        config=False,
    ),
    Command("data prepare", "peagle_ray.data.run:run", _cmd_data),
    Command(
        "data capture",
        "peagle_ray.capture.run:prepare_and_capture",
        _cmd_data,
        (arg("--prepare", action="store_true", help="Run `data prepare` first, in the same target session."),),
    ),
    Command(
        "train",
        "peagle_ray.train.job:run_training",
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
    ),
    Command(
        "export",
        "peagle_ray.train.checkpoint:export_checkpoint",
        _cmd_export,
        (
            arg("checkpoint", type=Path, help="A training checkpoint directory (checkpoint_*)."),
            arg("--out", type=Path, required=True, help="Directory for the speculators-format drafter."),
            arg("--num-speculative-tokens", type=int, help="K written to the config (default: trained K)."),
        ),
        config=False,
    ),
    Command("eval", "peagle_ray.eval.sweep:evaluate", _cmd_eval, (*DRAFTER_ARGS, JSON_ARG)),
    Command(
        "serve",
        "peagle_ray.serve.app:serve_forever",
        _cmd_serve,
        (
            arg(
                "--drafter",
                type=Path,
                help="Exported drafter directory (default: the registry's version holding adapt.alias, served "
                "with the decoder and K its last comparison chose; without a registry, the training run's export, "
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
    ),
    Command("adapt", "peagle_ray.adapt:run_adapt", _cmd_adapt, (JSON_ARG,)),
    Command(
        "demo",
        "peagle_ray.demo:run_demo",
        _cmd_demo,
        (
            arg("--scale", type=float, default=1.0, help="Multiply the training steps (2 = twice the budget)."),
            arg(
                "--no-wait",
                action="store_true",
                help="Stop everything after printing the results instead of serving until Ctrl-C.",
            ),
        ),
    ),
]
COMMAND_NAMES = [*dict.fromkeys(command.name.split()[0] for command in COMMANDS), "bench"]  # --help's order


@dataclass(frozen=True)
class Bench:
    """`peagle-ray bench <kind>`: peagle_ray.bench.<module>.<function>, reached from here only (the benchmarks sit
    on top of the product, which never imports them: pyproject.toml's import contracts). Its help is the first
    paragraph of the module's docstring, read without importing it; its options are the function's parameters
    annotated with an options.Opt (bench_options), its needs the parameters named cfg, drafters and progress
    (bench_needs); the module's log_to_mlflow(cfg, result), where it has one, logs the result."""

    module: str
    function: str

    def source(self) -> ast.Module:
        return module_source(f"peagle_ray.bench.{self.module}")

    @property
    def help(self) -> str:
        return summary(docstring(f"peagle_ray.bench.{self.module}"))

    @property
    def tracked(self) -> bool:
        return any(isinstance(n, ast.FunctionDef) and n.name == "log_to_mlflow" for n in self.source().body)

    def load(self) -> Callable:
        """The function: its module is imported only when `bench KIND` asks (the benchmarks pull in torch, and
        every other command's --help answers at once)."""
        return getattr(importlib.import_module(f"peagle_ray.bench.{self.module}"), self.function)


BENCHES = {  # the registry of benchmarks: `peagle-ray bench KIND` -> Bench(module, function)
    kind: Bench(module, function)
    for kind, module, function in [
        ("draft-latency", "draft_latency", "run"),
        ("train-memory", "train_memory", "run"),
        ("step-table", "step_table", "run"),
        ("host-syncs", "host_syncs", "run"),
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
    groups: dict[str, argparse._SubParsersAction] = {}

    def group(name: str, dest: str = "action") -> argparse._SubParsersAction:
        if name not in groups:
            parser = commands.add_parser(name, help=GROUPS[name], description=GROUPS[name])
            groups[name] = parser.add_subparsers(dest=dest, metavar=dest, required=True)
        return groups[name]

    for command in COMMANDS:
        name, _, action = command.name.partition(" ")
        doc = docstring(command.calls)
        parent = group(name) if action else commands
        sub = parent.add_parser(action or name, help=summary(doc), description=doc, formatter_class=RAW)
        _add_args(sub, command.args + (CONFIG_ARGS if command.config else ()))
        sub.set_defaults(func=command.run)
    kinds = group("bench", dest="kind")
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
    ray_was_running = ray_running()
    try:
        args.func(args)
        return 0
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
            leave_cluster()  # the cluster this command started


if __name__ == "__main__":
    sys.exit(main())
