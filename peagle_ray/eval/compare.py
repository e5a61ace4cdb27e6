"""Judge decoders against the target alone on the same prompts: the one comparison path. Evaluation's sweep,
adapt's judge, the demo (through adapt) and every benchmark call `compare`.

    compare(cfg, target, [drafter("new", export, 4), ngram(4), suffix(4)], prompts, timing) -> Comparison
      the target alone, then each candidate: one vLLM engine each (eval/vllm_run.py, its own process), over
      the same prompts; the first `timing` prompts of each category timed at batch 1
    Comparison.rows(name) -> {category: Row, "overall": Row} against the target alone (eval.metrics.summarize)
    Comparison.overall() -> {"target": Row, name: Row or {"skipped" | "failed": why}}

A candidate that cannot run here is kept as a note instead of a row: suffix decoding without arctic-inference
("skipped"), a peer whose engine fails ("failed"); a candidate marked `required` (the drafters being judged)
raises instead. Candidate specs are built here only (`drafter`, `ngram`, `suffix`), so every caller serves
n-gram and suffix decoding alike.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from peagle_ray.config import PeagleConfig
from peagle_ray.engine import engine_args, target_engine_env
from peagle_ray.eval.metrics import EngineRun, Row, summarize

SUFFIX_MISSING = (
    "vLLM's suffix decoding needs arctic-inference's suffix tree: scripts/build_suffix_decoding.sh builds it; put "
    "its directory on PYTHONPATH"
)
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

    @property
    def k(self) -> int:
        return int(self.spec["num_speculative_tokens"])


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


def suffix_available() -> bool:
    return importlib.util.find_spec("arctic_inference") is not None


@dataclass
class Comparison:
    """The target alone and each candidate over the same prompts: their engine runs, and a note for each
    candidate that did not run ({"skipped": why} or {"failed": why})."""

    baseline: EngineRun
    runs: dict[str, EngineRun] = field(default_factory=dict)
    ks: dict[str, int] = field(default_factory=dict)
    notes: dict[str, dict[str, str]] = field(default_factory=dict)

    def rows(self, name: str, keep: Callable[[str], bool] = lambda category: True) -> dict[str, Row]:
        """A candidate's rows (per category and "overall") over the categories `keep` accepts."""
        return summarize(self.ks[name], self.baseline.only(keep), self.runs[name].only(keep))

    def overall(self, keep: Callable[[str], bool] = lambda category: True) -> dict[str, dict]:
        """{"target": its row, candidate: its overall row or its note}, in the order they were judged."""
        base = self.baseline.only(keep)
        out: dict[str, dict] = {"target": dict(summarize(0, base, base)["overall"])}
        for name in [*self.runs, *self.notes]:
            out[name] = dict(self.rows(name, keep)["overall"]) if name in self.runs else self.notes[name]
        return out


def compare(
    cfg: PeagleConfig,
    target_dir: Path,
    candidates: list[Candidate],
    prompts: Prompts,
    timing: int | dict[str, int],
    progress: Callable[[str], None] | None = None,
) -> Comparison:
    """The target alone, then each candidate, over `prompts` (module docstring)."""
    out = Comparison(run_engine(cfg, target_dir, None, prompts, timing))
    for candidate in candidates:
        if candidate.spec["method"] == "suffix" and not suffix_available():
            out.notes[candidate.name] = {"skipped": SUFFIX_MISSING}
            continue
        if progress is not None:
            progress(f"{candidate.name} at K = {candidate.k}")
        try:
            run = run_engine(cfg, target_dir, candidate.spec, prompts, timing, candidate.warmup)
        except RuntimeError as err:  # a peer that fails to run is reported; the figures measured so far stay
            if candidate.required:
                raise
            out.notes[candidate.name] = {"failed": str(err)}
            continue
        out.runs[candidate.name], out.ks[candidate.name] = run, candidate.k
    return out


def run_engine(
    cfg: PeagleConfig,
    target_dir: Path,
    spec_config: dict | None,
    prompts: Prompts,
    timing_prompts: int | dict[str, int],
    warmup: list[list[int]] | None = None,
) -> EngineRun:
    """One engine (eval/vllm_run.py) over `prompts`; the first `timing_prompts` of each category (one count for
    all, or {category: count}) are timed at batch 1; `warmup` prompts are generated first, unmeasured."""
    import torch

    spec = {
        "engine_args": engine_args(cfg, target_dir, torch.cuda.is_available(), spec_config),
        "max_new_tokens": cfg.eval.max_new_tokens,
        "acceptance": prompts,
        "timing": {
            c: min(timing_prompts if isinstance(timing_prompts, int) else timing_prompts[c], len(p))
            for c, p in prompts.items()
        },
        "warmup": warmup or [],
    }
    with tempfile.TemporaryDirectory(prefix="peagle-eval-") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        log = Path(cfg.serving.log_dir) / "eval-engine.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as sink:
            proc = subprocess.run(
                [sys.executable, "-m", "peagle_ray.eval.vllm_run", str(spec_file), str(out_file)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=target_engine_env(cfg.target, on_gpu=torch.cuda.is_available()),
            )
        if proc.returncode != 0:
            raise RuntimeError(
                f"evaluation engine ({spec_config or 'target only'}) failed with exit code "
                f"{proc.returncode}; log: {log}"
            )
        return EngineRun(**json.loads(out_file.read_text()))
