"""Judge decoders against the target alone on the same prompts: the one comparison path. Evaluation's sweep,
adapt's judge, the demo (through adapt) and every benchmark call `compare`.

    compare(cfg, target, [drafter("new", export, 4), ngram(4), suffix(4)], prompts, timing) -> Comparison
      one vLLM engine per decoder (eval/vllm_run.py, its own process) over the same prompts; the target alone
      and up to eval.engines_at_once - 1 candidates alive side by side, the first `timing` prompts of each
      category timed at batch 1 by each engine in turn, prompt by prompt (the order rotating), so that drift
      between engine runs (+-20% on the 2-core box) cannot decide a verdict; then each engine's untimed
      prompts. More candidates: groups, each timed beside its own target-alone engine
    Comparison.rows(name) -> {category: Row, "overall": Row} against the target alone (eval.metrics.summarize)
    Comparison.overall() -> {"target": Row, name: Row or {"failed": why}}

A peer whose engine fails is kept as a note instead of a row ({"failed": why}); a candidate marked `required`
(the drafters being judged) raises instead, and so does suffix decoding where its suffix tree was not built
(`make setup` builds it into the virtualenv). Candidate specs are built here only (`drafter`, `ngram`,
`suffix`), so every caller serves n-gram and suffix decoding alike.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from peagle_ray.config import PeagleConfig
from peagle_ray.engine import engine_args, target_engine_env
from peagle_ray.eval.metrics import EngineRun, Row, summarize
from peagle_ray.hybrid import (
    CONFIG_KEY,
    ENGINE_ARGS as HYBRID_ENGINE_ARGS,
    STEP_COST_KEY,
    SUFFIX_MISSING,
    suffix_available,
)
from peagle_ray.spec_counters import SpecStats

Prompts = dict[str, list[list[int]]]  # category -> prompt token ids


@dataclass(frozen=True)
class Candidate:
    """One decoder to judge: a name, vLLM's speculative_config, prompts generated first and unmeasured
    (`warmup`: suffix decoding's response cache), and whether a failure to run raises (`required`) or is
    recorded."""

    name: str
    spec: dict
    warmup: list[list[int]] = field(default_factory=list)
    required: bool = False
    additional_config: dict = field(default_factory=dict)  # vLLM's additional_config (the hybrid's options)

    @property
    def k(self) -> int:
        return int(self.spec["num_speculative_tokens"])

    @property
    def uses_suffix(self) -> bool:
        """Suffix decoding alone, or in the hybrid (peagle_ray/hybrid.py, asked for in additional_config)."""
        return self.spec.get("method") == "suffix" or CONFIG_KEY in self.additional_config


def drafter(name: str, export_dir: Path, k: int) -> Candidate:
    """A trained drafter (P-EAGLE or EAGLE-3 export) at K = k; required: a drafter under judgement that fails
    to run is an error, not a finding."""
    from peagle_ray.export.speculators import read_drafter, speculative_config

    return Candidate(name, speculative_config(read_drafter(Path(export_dir)), k), required=True)


def ngram(k: int, name: str | None = None) -> Candidate:
    """vLLM's n-gram drafter (prompt lookup, no training): n-grams of 2 to 4 tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return Candidate(name or "ngram", spec)


def suffix(k: int, warmup: list[list[int]] | None = None) -> Candidate:
    """vLLM's suffix decoding (training-free; `warmup` prompts fill its response cache first)."""
    return Candidate("suffix", {"method": "suffix", "num_speculative_tokens": k}, list(warmup or []))


def hybrid(
    name: str,
    export_dir: Path,
    k: int,
    threshold: float | str | None = None,
    warmup=None,
    drafter_k: int | None = None,
    required: bool = False,
) -> Candidate:
    """A trained drafter and suffix decoding in one engine at K = k (peagle_ray/hybrid.py): suffix decoding's
    draft where its score reaches `threshold` (default K / 2), else the drafter's (cut to `drafter_k` tokens).
    On a vLLM release the plugin was not written for, its engine logs the error and the drafter drafts alone."""
    from peagle_ray.hybrid import engine_config

    spec = drafter(name, export_dir, k).spec
    return Candidate(name, spec, list(warmup or []), required, engine_config(threshold, drafter_k))


def check_suffix(candidate: Candidate) -> None:
    """A clear error, naming the command that builds it, where a candidate uses suffix decoding and its suffix
    tree is missing (vLLM's own error would come from inside the engine)."""
    if candidate.uses_suffix and not suffix_available():
        raise RuntimeError(SUFFIX_MISSING.format(python=sys.executable))


@dataclass
class Comparison:
    """The target alone and each candidate over the same prompts: their engine runs, and a note for each
    candidate that did not run ({"failed": why}). A candidate's speedup is against the target-alone engine
    timed beside it (`baselines`; the first group's is `baseline`, whose outputs are every candidate's
    reference for mismatches)."""

    baseline: EngineRun
    runs: dict[str, EngineRun] = field(default_factory=dict)
    ks: dict[str, int] = field(default_factory=dict)
    notes: dict[str, dict[str, str]] = field(default_factory=dict)
    baselines: dict[str, EngineRun] = field(default_factory=dict)

    def rows(self, name: str, keep: Callable[[str], bool] = lambda category: True) -> dict[str, Row]:
        """A candidate's rows (per category and "overall") over the categories `keep` accepts."""
        base = self.baselines.get(name, self.baseline)
        return summarize(self.ks[name], base.only(keep), self.runs[name].only(keep))

    def overall(self, keep: Callable[[str], bool] = lambda category: True) -> dict[str, dict]:
        """{"target": its row, candidate: its overall row (the hybrid's with its counts per source,
        "by_source") or its note}, in the order they were judged."""
        base = self.baseline.only(keep)
        out: dict[str, dict] = {"target": dict(summarize(0, base, base)["overall"])}
        for name in [*self.runs, *self.notes]:
            out[name] = dict(self.rows(name, keep)["overall"]) if name in self.runs else self.notes[name]
            if sources := self.by_source(name, keep):
                out[name]["by_source"] = {source: counts.to_json() for source, counts in sources.items()}
        return out

    def by_source(self, name: str, keep: Callable[[str], bool] = lambda category: True) -> dict[str, SpecStats]:
        """The hybrid's counts per source over the categories `keep` accepts ({} for any other decoder)."""
        total: dict[str, SpecStats] = {}
        run = self.runs.get(name)
        for category, part in run.acceptance.items() if run else []:
            for source, counts in part.get("by_source", {}).items():
                if keep(category):
                    total[source] = total.get(source, SpecStats()) + SpecStats(**counts)
        return total


def compare(
    cfg: PeagleConfig,
    target_dir: Path,
    candidates: list[Candidate],
    prompts: Prompts,
    timing: int | dict[str, int],
    progress: Callable[[str], None] | None = None,
) -> Comparison:
    """The target alone and each candidate over `prompts` (module docstring): every candidate is checked
    before the first engine starts; then groups of eval.engines_at_once engines (the target alone and up to
    N - 1 candidates) are started side by side and timed in turn, prompt by prompt (`judge_group`)."""
    for candidate in candidates:
        check_suffix(candidate)
    size = cfg.eval.engines_at_once - 1
    counts = timing_counts(prompts, timing)
    out: Comparison | None = None
    for start in range(0, max(len(candidates), 1), size):
        group = candidates[start : start + size]
        runs, notes = judge_group(cfg, target_dir, group, prompts, counts, out is None, progress)
        target = runs.pop(TARGET)
        if out is None:
            out = Comparison(target)
        baseline = EngineRun(out.baseline.acceptance, target.timing, target.engine_start_s)
        for candidate in group:
            if candidate.name in runs:
                out.runs[candidate.name], out.ks[candidate.name] = runs[candidate.name], candidate.k
                out.baselines[candidate.name] = baseline
        out.notes.update(notes)
    assert out is not None
    return out


TARGET = "target"


def timing_counts(prompts: Prompts, timing: int | dict[str, int]) -> dict[str, int]:
    """{category: how many of its first prompts are timed}: one count for all, or one per category."""
    return {c: min(timing if isinstance(timing, int) else timing.get(c, 0), len(p)) for c, p in prompts.items()}


def judge_group(
    cfg: PeagleConfig,
    target_dir: Path,
    group: list[Candidate],
    prompts: Prompts,
    counts: dict[str, int],
    target_rest: bool,
    progress: Callable[[str], None] | None,
) -> tuple[dict[str, EngineRun], dict[str, dict[str, str]]]:
    """The target alone and `group` alive side by side: each timed prompt decoded by every engine in turn,
    the order rotating from prompt to prompt, then each engine's untimed prompts (the target's only when
    `target_rest`: the first group's outputs are the reference). A candidate whose engine fails is a note,
    unless it is required."""
    say = progress or (lambda _line: None)
    decoders = [Candidate(TARGET, {}, required=True), *group]
    gpu_share = len(decoders) if _on_gpu() else None
    engines: dict[str, DrivenEngine] = {}
    notes: dict[str, dict[str, str]] = {}

    def failed(name: str, err: RuntimeError) -> None:
        engines.pop(name).close()
        if next(d for d in decoders if d.name == name).required:
            raise err
        notes[name] = {"failed": str(err)}

    host = engine_host(cfg)
    try:
        for d in decoders:  # started together; each waits for its own engine
            engines[d.name] = DrivenEngine(cfg, target_dir, d, prompts, counts, gpu_share, host)
        for name in list(engines):
            try:
                engines[name].ready()
            except RuntimeError as err:
                failed(name, err)
        say(f"timing {', '.join(engines)} in turn on {sum(counts.values())} prompts")
        turn = 0
        for category, n in counts.items():
            for index in range(n):
                names = list(engines)
                for name in names[turn % len(names) :] + names[: turn % len(names)]:
                    try:
                        engines[name].ask({"time": [category, index]})
                    except RuntimeError as err:
                        failed(name, err)
                turn += 1
        runs = {}
        for name in list(engines):
            say(f"{name}: the untimed prompts" if name != TARGET or target_rest else f"{name}: done")
            try:
                runs[name] = EngineRun(**engines[name].ask({"finish": name != TARGET or target_rest}))
            except RuntimeError as err:
                failed(name, err)
        return runs, notes
    finally:
        for engine in engines.values():
            engine.close()


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


class DrivenEngine:
    """A vllm_run process (eval/vllm_run.py), forked by `host` where there is one (CPU) or started on its own:
    started at once, then asked command by command; its log goes to serving.log_dir/eval-engine.log."""

    def __init__(
        self,
        cfg,
        target_dir,
        decoder: Candidate,
        prompts,
        counts,
        gpu_share: int | None,
        host: EngineHost | None = None,
    ):
        spec_config = decoder.spec or None
        self.what = f"evaluation engine ({decoder.name}: {spec_config or 'target only'})"
        spec = engine_spec(cfg, target_dir, spec_config, prompts, counts, decoder.warmup)
        extra = dict(decoder.additional_config)
        if cfg.eval.target_step_ms:  # every engine of a comparison alike: an emulated larger target
            extra[STEP_COST_KEY] = cfg.eval.target_step_ms
        if extra:
            spec["engine_args"]["additional_config"] = extra
        if CONFIG_KEY in extra:
            spec["engine_args"].update(HYBRID_ENGINE_ARGS)
        if gpu_share:  # engines side by side share the GPU's memory
            spec["engine_args"]["gpu_memory_utilization"] = round(0.85 / gpu_share, 3)
        self.tmp = tempfile.TemporaryDirectory(prefix="peagle-eval-")
        spec_file = Path(self.tmp.name) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        self.log = Path(cfg.serving.log_dir) / "eval-engine.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.ended = False  # a forked engine that answered `finish`, reported an error or closed its pipe
        if host is not None:  # forked by this process's engine host (vLLM already imported there)
            self.pid, self.commands, self.replies = host.fork(spec_file, self.log)
            return
        read, write = os.pipe()
        with self.log.open("a") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "peagle_ray.eval.vllm_run", str(spec_file), "--driven", str(write)],
                stdin=subprocess.PIPE,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=target_engine_env(cfg.target, on_gpu=_on_gpu()),
                pass_fds=(write,),
                text=True,
            )
        os.close(write)
        self.replies = os.fdopen(read)
        assert self.proc.stdin is not None
        self.commands = self.proc.stdin

    def _answer(self):
        line = self.replies.readline()
        if not line:
            self.ended = True
            code = self.proc.wait() if self.proc is not None else "unknown (forked by the engine host)"
            raise RuntimeError(f"{self.what} failed with exit code {code}; log: {self.log}")
        answer = json.loads(line)
        if isinstance(answer, dict) and "error" in answer:  # vllm_run's own report (eval/vllm_run.py driven)
            self.ended = True
            raise RuntimeError(f"{self.what} failed: {answer['error']}; log: {self.log}")
        return answer

    def ready(self) -> None:
        self._answer()

    def ask(self, command: dict):
        try:
            self.commands.write(json.dumps(command) + "\n")
            self.commands.flush()
        except BrokenPipeError:
            pass  # the process ended: _answer reads its exit
        answer = self._answer()
        self.ended = self.ended or "finish" in command
        return answer

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        elif self.pid is not None and not self.ended:  # an ended engine exits by itself (its pid may be reused)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                self.commands.close()
        self.replies.close()
        self.tmp.cleanup()


class EngineHost:
    """A process that imports vLLM once and forks each evaluation engine from it (eval/vllm_run.py `--host`):
    a fresh process pays the import (~20 CPU-s on the 2-core box) before its LLM(), a forked one does not
    (~10 CPU-s in all for an engine on the tiny target, against ~32). CPU only: a process that forks must not
    have touched CUDA. One per driver process and engine environment (`engine_host`), kept until the process
    exits; it ends when its socket closes (the driver exited or was killed)."""

    def __init__(self, env: dict[str, str], log: Path):
        import socket

        self.sock, theirs = socket.socketpair()
        self.log = log
        self.lock = threading.Lock()  # one fork request at a time (comparisons may run in threads)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "peagle_ray.eval.vllm_run", "--host", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(theirs.fileno(),),
            )
        theirs.close()
        self.answers = self.sock.makefile("r")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, spec_file: Path, log: Path):
        """(pid, commands file, replies file) of a driven engine forked for `spec_file`, logging to `log`."""
        import socket

        commands_r, commands_w = os.pipe()
        replies_r, replies_w = os.pipe()
        sink = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            with self.lock:
                request = json.dumps({"spec": str(spec_file), "cwd": os.getcwd()}).encode()
                socket.send_fds(self.sock, [request], [commands_r, replies_w, sink])
                line = self.answers.readline()
        except OSError as err:
            line = ""
            why = f" ({err})"
        else:
            why = ""
        finally:
            for fd in (commands_r, replies_w, sink):
                os.close(fd)
        if not line:
            os.close(commands_w)
            os.close(replies_r)
            code = self.proc.wait()
            raise RuntimeError(f"the evaluation's engine host ended with exit code {code}{why}; log: {self.log}")
        return int(line), os.fdopen(commands_w, "w"), os.fdopen(replies_r)

    def close(self) -> None:
        self.answers.close()
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_HOSTS: dict[tuple, EngineHost] = {}
_HOSTS_LOCK = threading.Lock()
# what an engine's environment is made of (target_engine_env); the rest of os.environ (PYTEST_CURRENT_TEST, ...)
# does not choose the host
ENGINE_ENV = ("VLLM_", "OMP_", "KMP_", "LD_", "CUDA_", "HF_", "TRANSFORMERS_", "TORCH", "PEAGLE_", "PYTHON")


def engine_host(cfg) -> EngineHost | None:
    """This process's engine host for cfg's engine environment, started on first use (None on a GPU: engines
    there start as processes of their own)."""
    if _on_gpu():
        return None
    env = target_engine_env(cfg.target, on_gpu=False)
    key = tuple(sorted((name, value) for name, value in env.items() if name.startswith(ENGINE_ENV)))
    with _HOSTS_LOCK:
        host = _HOSTS.get(key)
        if host is None or not host.alive():
            host = _HOSTS[key] = EngineHost(env, Path(cfg.serving.log_dir) / "eval-engine.log")
        return host


@atexit.register
def close_hosts() -> None:
    """End this process's engine hosts (at exit; their engines were closed with their comparisons)."""
    with _HOSTS_LOCK:
        while _HOSTS:
            _HOSTS.popitem()[1].close()


def engine_spec(cfg, target_dir, spec_config, prompts: Prompts, counts: dict[str, int], warmup) -> dict:
    """vllm_run's SPEC for one decoder."""
    return {
        "engine_args": engine_args(cfg, target_dir, _on_gpu(), spec_config),
        "max_new_tokens": cfg.eval.max_new_tokens,
        "acceptance": prompts,
        "timing": counts,
        "warmup": warmup or [],
    }


def run_engine(
    cfg: PeagleConfig,
    target_dir: Path,
    spec_config: dict | None,
    prompts: Prompts,
    timing_prompts: int | dict[str, int],
    warmup: list[list[int]] | None = None,
) -> EngineRun:
    """One engine alone (eval/vllm_run.py) over `prompts`; the first `timing_prompts` of each category (one
    count for all, or {category: count}) are timed at batch 1; `warmup` prompts are generated first,
    unmeasured. Comparisons time engines side by side instead (`compare`)."""
    counts = timing_counts(prompts, timing_prompts)
    alone = Candidate("alone", spec_config or {}, list(warmup or []))
    engine = DrivenEngine(cfg, target_dir, alone, prompts, counts, None, engine_host(cfg))
    try:
        engine.ready()
        for category, n in counts.items():
            for index in range(n):
                engine.ask({"time": [category, index]})
        return EngineRun(**engine.ask({"finish": True}))
    finally:
        engine.close()
