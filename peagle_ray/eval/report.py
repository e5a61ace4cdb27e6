"""Evaluation's reporting: the console table and the MLflow record (metrics against K, the per-position table,
plots, the recommendation tags) of a sweep's results (eval/sweep.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from peagle_ray.config import PeagleConfig
from peagle_ray.layout import eval_name

if TYPE_CHECKING:
    from peagle_ray.eval.metrics import SweepResult


def format_table(results: SweepResult) -> str:
    """Per algorithm at its fastest K: Pos 1..K acceptance (%) and Avg Length per category, with tok/s; and
    whether that K is recommended."""
    lines = []
    for algorithm, entry in results.algorithms.items():
        best, k = entry.best, entry.best_k
        verdict = (
            f"recommended K = {k}"
            if entry.recommended_k
            else f"at its fastest K = {k}; recommended: no drafting, the target alone is served"
        )
        head = ["Category", *[f"Pos {i}" for i in range(1, k + 1)], "Avg Length", "tok/s", "speedup"]
        lines += [
            f"{algorithm} ({verdict})",
            "| " + " | ".join(head) + " |",
            "|" + "|".join("---" for _ in head) + "|",
        ]
        for category, row in best.items():
            cells = [
                category,
                *[f"{100 * r:.1f}" for r in row["acceptance_per_position"]],
                f"{row['acceptance_length']:.2f}",
                f"{row['tokens_per_s']:.1f}",
                f"{row['speedup'] or 0:.2f}x" + (f" +- {row['speedup_se']:.2f}" if row.get("speedup_se") else ""),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"greedy mismatches against the target alone: {results.greedy_mismatches}")
    return "\n".join(lines)


def log_results(
    uri: str, cfg: PeagleConfig, results: SweepResult, drafters: dict[str, Path], work_dir: Path
) -> dict[str, str]:
    """eval/* metrics (AL, tokens/s, speedup at step = K; acceptance at step = position, one metric per K,
    and as the table eval/acceptance_per_position.json), plots, work_dir/eval.json and the `eval.recommended_k`
    tag into each drafter's training run (from its provenance), else a run named eval-<algorithm> that ends
    FINISHED. Suites other than the validation split log under their own prefix (eval-mt-bench/..., a section
    of its own in the UI), so a MT-Bench sweep does not draw over the validation curves. Returns
    {algorithm: run_id}. A tag, not a param: params are immutable, and a later sweep may recommend another K."""
    from peagle_ray.export.speculators import PROVENANCE
    from peagle_ray.plots import plot_acceptance, plot_tokens_per_s
    from peagle_ray.tracking import log_files, log_metrics, log_table, results_run, set_tag

    as_json = results.to_json()
    plots = [
        plot_tokens_per_s(as_json, work_dir / "eval_tokens_per_s_vs_k.png"),
        plot_acceptance(as_json, work_dir / "eval_acceptance_per_position.png"),
    ]
    runs, sweep = {}, time.strftime("%Y-%m-%dT%H:%M:%S")
    prefix = eval_name(results.suite)
    for algorithm, entry in results.algorithms.items():
        provenance_file = Path(drafters[algorithm]) / PROVENANCE
        trained_in = json.loads(provenance_file.read_text()).get("run_id") if provenance_file.is_file() else None
        metrics: list[tuple[str, float, int]] = []
        table: dict[str, list] = {"sweep": [], "k": [], "position": [], "acceptance": []}  # MLflow appends each sweep
        for k, rows in entry.by_k.items():
            overall = rows["overall"]
            metrics += [  # these against K
                (f"{prefix}/acceptance_length", overall["acceptance_length"], int(k)),
                (f"{prefix}/tokens_per_s", overall["tokens_per_s"], int(k)),
                (f"{prefix}/speedup_vs_target", overall["speedup"] or 0.0, int(k)),
            ]
            for position, rate in enumerate(overall["acceptance_per_position"], start=1):  # one curve per K
                metrics.append((f"{prefix}/acceptance_by_position_k{int(k)}", rate, position))
                for column, value in zip(table, (sweep, int(k), position, rate), strict=True):
                    table[column].append(value)
        with results_run(uri, cfg, trained_in, f"eval-{algorithm}", work_dir) as run_id:
            log_metrics(uri, run_id, metrics)
            log_table(uri, run_id, table, f"{prefix}/acceptance_per_position.json")
            set_tag(uri, run_id, "eval.recommended_k", entry.recommended_k)
            if entry.recommendation:
                set_tag(uri, run_id, "eval.recommendation", entry.recommendation)
            log_files(uri, run_id, [*plots, work_dir / "eval.json"], artifact_path=prefix)
        runs[algorithm] = run_id
    return runs
