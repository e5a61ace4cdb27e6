"""The pure part of evaluation: one engine's raw counts and timings (EngineRun, vllm_run's JSON) -> per-category
metrics (Row), their spread, and the verdict on K; the sweep's result types (AlgorithmResult, SweepResult, whose
to_json() is eval.json). No vLLM, no MLflow: tested with literal values (tests/test_eval.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import NotRequired, TypedDict

from peagle_ray.export.speculators import Recommendation
from peagle_ray.spec_counters import SpecStats


class Row(TypedDict):
    """One decoder's metrics on one category (or "overall") at one K: what eval.json, the tables, adapt's
    verdicts and the benchmarks read."""

    k: int  # tokens drafted per step (0: the target alone)
    acceptance_per_position: list[float]
    acceptance_length: float  # AL: tokens per target step, the bonus token included
    tokens_per_s: float  # timed prompts, batch 1
    baseline_tokens_per_s: float  # the target alone on the same prompts
    speedup: float | None
    speedup_se: float | None  # its standard error, same estimator (speedup_and_error; None under 2 prompts)
    timed_prompts: int
    step_cost_vs_target: float | None  # one draft-and-verify step in target decode steps
    greedy_mismatches: int  # prompts whose greedy output differs from the target alone's
    speedup_vs_eagle3: NotRequired[float | None]  # P-EAGLE's rows, when both algorithms ran
    by_source: NotRequired[dict[str, dict]]  # the hybrid's counts per source (SpecStats.to_json())
    prompt_acceptance_lengths: NotRequired[list[float]]  # each timed prompt's AL, in order (paired gains)


@dataclass(frozen=True)
class EngineRun:
    """One engine over a prompt set (eval/vllm_run.py's OUT): per category, `acceptance` (every prompt's output
    tokens and vLLM's counters over all of them) and `timing` (the batch-1 prompts: tokens, seconds, per prompt
    [tokens, seconds], counters)."""

    acceptance: dict[str, dict]
    timing: dict[str, dict]
    engine_start_s: float = 0.0

    def only(self, keep: Callable[[str], bool]) -> EngineRun:
        """This run restricted to the categories `keep` accepts (e.g. one suite of several run together)."""
        pick = lambda part: {c: v for c, v in part.items() if keep(c)}  # noqa: E731
        return EngineRun(pick(self.acceptance), pick(self.timing), self.engine_start_s)


ByK = dict[int, dict[str, Row]]  # K -> category (and "overall") -> row


@dataclass
class AlgorithmResult:
    """One drafter's sweep: its rows at every K, then (decide) the fastest K and the verdict on it."""

    drafter: str  # its export directory
    by_k: ByK = field(default_factory=dict)
    best_k: int = 0  # the fastest K
    recommended_k: int = 0  # the K to serve; 0: no drafting (not measurably faster than the target alone)
    recommendation: str = ""  # why

    @property
    def best(self) -> dict[str, Row]:
        """The rows at the fastest K."""
        return self.by_k[self.best_k]

    def decide(self) -> Recommendation:
        recommendation = recommend_k(self.by_k)
        self.best_k, self.recommendation = recommendation.k, recommendation.reason
        self.recommended_k = recommendation.k if recommendation.draft else 0
        return recommendation

    def to_json(self) -> dict:
        return {
            "drafter": self.drafter,
            "by_k": self.by_k,
            "best_k": self.best_k,
            "best": self.best,
            "recommended_k": self.recommended_k,
            "recommendation": self.recommendation,
        }


@dataclass
class SweepResult:
    """The evaluation stage's artifact (eval.json is its to_json()): what was measured, the target alone's
    tokens/s per category, and each drafter's AlgorithmResult."""

    target: str
    suite: str
    categories: list[str]
    k_values: list[int]
    prompts_per_category: int
    timing_prompts: int
    max_new_tokens: int
    dtype: str
    target_only: dict[str, dict[str, float]] = field(default_factory=dict)  # category -> {"tokens_per_s"}
    algorithms: dict[str, AlgorithmResult] = field(default_factory=dict)

    @property
    def recommended_k(self) -> dict[str, int]:
        return {name: a.recommended_k for name, a in self.algorithms.items()}

    @property
    def greedy_mismatches(self) -> int:
        """Prompts whose greedy output differed from the target alone's, over every drafter and K."""
        return sum(rows["overall"]["greedy_mismatches"] for a in self.algorithms.values() for rows in a.by_k.values())

    def to_json(self) -> dict:
        """eval.json: the fields, then each algorithm under its name, recommended_k, greedy_mismatches."""
        out: dict = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "algorithms"}
        out.update({name: a.to_json() for name, a in self.algorithms.items()})
        out["recommended_k"] = self.recommended_k
        out["greedy_mismatches"] = self.greedy_mismatches
        return out


def summarize(k: int, baseline: EngineRun, run: EngineRun) -> dict[str, Row]:
    """Per category and "overall" metrics of one speculative run against the target-only run.

    e.g. a category with counters {drafts 10, accepted 14, per position [8, 5, 1]} -> acceptance [0.8, 0.5,
    0.1], AL 2.4; tokens/s = timed tokens / seconds; speedup = tokens/s / the baseline's tokens/s;
    step_cost_vs_target = the timing prompts' AL / speedup (e.g. AL 2.5 at 2.0x -> 1.25).
    """
    rows: dict[str, Row] = {}
    parts = []
    for category, acceptance in run.acceptance.items():
        t, b = run.timing[category], baseline.timing[category]
        expected = baseline.acceptance[category]["tokens"]
        wrong = sum(x != y for x, y in zip(acceptance["tokens"], expected, strict=True))  # prompts that differ
        part = (
            SpecStats(**acceptance["counters"]),
            t["tokens"],
            t["seconds"],
            SpecStats(**t["counters"]),
            b["tokens"],
            b["seconds"],
            wrong,
            timed_pairs(t.get("per_prompt", []), b.get("per_prompt", [])),
            prompt_acceptance_lengths(t.get("per_prompt", [])),
        )
        rows[category] = _row(k, *part)
        parts.append(part)
    rows["overall"] = _row(k, *(sum(column[1:], column[0]) for column in zip(*parts, strict=True)))  # each field summed
    return rows


def timed_pairs(timed: list[list[float]], baseline: list[list[float]]) -> list[tuple[float, float, float, float]]:
    """Per timed prompt (tokens, seconds, the target alone's tokens, its seconds) from the engines' per-prompt
    [tokens, seconds, ...] entries, the prompts both timed (seconds > 0).

    e.g. [[10, 1.0, 3, 5]] against [[10, 2.0]] -> [(10, 1.0, 10, 2.0)]."""
    return [(t[0], t[1], b[0], b[1]) for t, b in zip(timed, baseline, strict=True) if t[1] and b[0] and b[1]]


def speedup_and_error(pairs: list[tuple[float, float, float, float]]) -> tuple[float | None, float | None]:
    """The speedup over the target alone as the ratio of the two engines' tokens/s over all timed prompts,
    (sum n / sum s) / (sum bn / sum bs), and its standard error from the same estimator (the delta method on
    the per-prompt means: SE = R * sd(z) / sqrt(m), z_i = n_i/mean(n) - s_i/mean(s) - bn_i/mean(bn) +
    bs_i/mean(bs)); (None, None) with nothing timed, the error None under 2 prompts. Long and short prompts
    weigh as their tokens do, in the speedup and in its error alike.

    e.g. [(10, 1.0, 10, 2.0), (10, 2.0, 10, 2.0)] -> R = (20 / 3) / (20 / 4) = 1.333; z = [1/3, -1/3],
    sd(z) = 0.471 -> SE = 1.333 * 0.471 / sqrt(2) = 0.444."""
    m = len(pairs)
    if m == 0:
        return None, None
    means = [sum(column) / m for column in zip(*pairs, strict=True)]
    n, s, bn, bs = means
    ratio = (n / s) / (bn / bs)
    if m < 2:
        return ratio, None
    z = [p[0] / n - p[1] / s - p[2] / bn + p[3] / bs for p in pairs]
    return ratio, ratio * (sum(v * v for v in z) / (m - 1) / m) ** 0.5  # mean(z) = 0 by construction


def prompt_acceptance_lengths(timed: list[list[float]]) -> list[float]:
    """Per timed prompt, its AL from the engine's per-prompt [tokens, seconds, drafts, accepted tokens]
    entries (1.0 where it drafted nothing; entries without counters are left out).

    e.g. [[12, 1.0, 4, 6], [5, 0.5, 0, 0], [3, 0.1]] -> [2.5, 1.0]."""
    return [1 + t[3] / t[2] if t[2] else 1.0 for t in timed if len(t) >= 4]


def standard_error(values: list[float]) -> float | None:
    """The standard error of the mean of `values` (None under 2 values). e.g. [2.0, 1.0] -> 0.5."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5


def _row(
    k,
    counters: SpecStats,
    tokens,
    seconds,
    timed_counters: SpecStats,
    base_tokens,
    base_seconds,
    mismatches,
    pairs: list[tuple[float, float, float, float]],
    prompt_als: list[float],
) -> Row:
    tps = tokens / seconds if seconds else 0.0
    base = base_tokens / base_seconds if base_seconds else 0.0
    speedup = tps / base if base else None  # = speedup_and_error's ratio where every timed prompt is paired
    se = speedup_and_error(pairs)[1]
    return Row(
        k=k,
        acceptance_per_position=[round(r, 4) for r in counters.acceptance_per_position],
        acceptance_length=round(counters.acceptance_length, 4),
        tokens_per_s=round(tps, 2),
        baseline_tokens_per_s=round(base, 2),
        speedup=round(speedup, 3) if speedup else None,
        speedup_se=None if se is None else round(se, 3),
        timed_prompts=len(pairs),
        step_cost_vs_target=round(timed_counters.acceptance_length / speedup, 3) if speedup else None,
        greedy_mismatches=mismatches,
        prompt_acceptance_lengths=[round(al, 4) for al in prompt_als],
    )


def fastest_k(by_k: ByK) -> int:
    """The K with the best measured overall tokens/s (ties: the smaller K)."""
    return max(sorted(by_k), key=lambda k: by_k[k]["overall"]["tokens_per_s"])


def selection_z(candidates: int) -> float:
    """How many standard errors the best of `candidates` measured speedups must clear above 1: 2 for one
    (one-sided, P(Z > 2) = 0.0228), more for the best of several, which is picked because it measured high
    (Bonferroni: P(Z > z) = 0.0228 / candidates). e.g. 1 -> 2.0, 2 -> 2.278, 3 -> 2.428, 4 -> 2.531."""
    from statistics import NormalDist

    normal = NormalDist()
    return normal.inv_cdf(1 - (1 - normal.cdf(2.0)) / max(1, candidates))


def recommend_k(by_k: ByK) -> Recommendation:
    """Draft at the fastest K only when it is measurably faster than the target alone: its overall speedup less
    selection_z(the K values measured) standard errors (the speedup itself when under 2 prompts were timed)
    must be above 1. Otherwise the recommendation is no drafting, and says why.

    e.g. of K 2 and 4, the fastest K 4 at 1.30x +- 0.05 -> draft at K = 4; at 1.05x +- 0.04 -> no drafting
    (1.05 - 2.278 x 0.04 <= 1)."""
    k = fastest_k(by_k)
    overall = by_k[k]["overall"]
    speedup, se = overall.get("speedup"), overall.get("speedup_se")
    z = selection_z(len(by_k))
    spread = (
        f"+- {se:.2f} (standard error over {overall.get('timed_prompts')} timed prompts; best of {len(by_k)} "
        f"K values: must clear 1 by {z:.2f} standard errors)"
        if se
        else "(spread unknown: fewer than 2 timed prompts)"
    )
    measured = f"the fastest K = {k} ran at {speedup or 0:.2f}x the target alone {spread}"
    if speedup is not None and speedup - z * (se or 0.0) > 1.0:
        return Recommendation(True, k, measured)
    return Recommendation(False, k, f"no K is measurably faster than the target alone: {measured}")


SIMPLEST_FIRST = ("suffix", "drafter", "hybrid")  # suffix decoding runs no drafter; the hybrid runs both


def pick_decoder(rows: dict[str, dict], k: int, exact: bool = True) -> Recommendation:
    """The decoder to serve from each one's overall row against the target alone on the same prompts, all
    from one comparison ({"drafter" | "suffix" | "hybrid": Row, or {"failed": why}; "target" is ignored):
    among those measurably faster (speedup less selection_z(decoders measured) standard errors above 1: the
    best of several is picked because it measured high; with `exact`, float32, no greedy mismatch), the
    fastest, except that a simpler one (SIMPLEST_FIRST) within the fastest's standard error of it wins, so
    that a verdict does not flip on noise. None of them: the target alone.

    e.g. suffix 1.80x +- 0.10, drafter 0.93x +- 0.02, hybrid 1.85x +- 0.10 -> suffix (1.80 - 2.428 x 0.10 > 1,
    and 1.80 >= 1.85 - 0.10)."""
    measured = {name: rows[name] for name in SIMPLEST_FIRST if name in rows and "failed" not in rows[name]}
    z = selection_z(len(measured))

    def spread(row) -> float:
        return row.get("speedup_se") or 0.0

    def faster(row) -> bool:
        speedup = row.get("speedup")
        lossless = not (exact and row.get("greedy_mismatches"))
        return speedup is not None and speedup - z * spread(row) > 1.0 and lossless

    summary = "; ".join(
        f"{name} {row.get('speedup') or 0:.2f}x +- {spread(row):.2f}"
        + (f" ({row['greedy_mismatches']} mismatches)" if row.get("greedy_mismatches") else "")
        for name, row in measured.items()
    )
    timed = max((row.get("timed_prompts") or 0 for row in measured.values()), default=0)
    measured_line = (
        f"{summary} the target alone's speed at K = {k} over {timed} timed prompts (best of {len(measured)}: "
        f"must clear 1 by {z:.2f} standard errors)"
    )
    eligible = [name for name, row in measured.items() if faster(row)]
    if not eligible:
        return Recommendation(False, k, f"nothing measurably faster than the target alone: {measured_line}")
    best = max(eligible, key=lambda name: measured[name]["speedup"])
    floor = measured[best]["speedup"] - spread(measured[best])
    chosen = next(name for name in eligible if measured[name]["speedup"] >= floor)
    return Recommendation(True, k, f"{chosen} is served: {measured_line}", decoder=chosen)
