"""Every chart the stages log to MLflow, drawn from their results into PNG files (matplotlib, headless).

acceptance_plot     training: validation acceptance per draft position (the run's best checkpoint)
plot_tokens_per_s   evaluation: decode tokens/s against K, per algorithm, the target alone as a line
plot_acceptance     evaluation: acceptance per position at each algorithm's best K
plot_curve          bench learning-curve: AL against training tokens
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from peagle_ray import layout


@contextmanager
def figure(path: Path, size: tuple[float, float] = (5, 3.2)) -> Iterator:
    """Axes to draw on; on leaving, the figure is laid out, written to `path` (its folder made) and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def acceptance_plot(metrics: dict, path: Path, title: str) -> Path:
    prefix = layout.VAL_ACCEPTANCE_POS
    positions = sorted(int(k.removeprefix(prefix)) for k in metrics if k.startswith(prefix))
    rates = [100 * metrics[layout.acceptance_metric(i)] for i in positions]
    with figure(path) as ax:
        ax.bar(positions, rates, color="#3b7dd8")
        ax.set(xlabel="draft position", ylabel="accepted (%)", title=title, ylim=(0, 100), xticks=positions)
        for x, y in zip(positions, rates, strict=True):
            ax.text(x, y + 1, f"{y:.1f}", ha="center", fontsize=8)
    return path


def plot_tokens_per_s(results: dict, path: Path) -> Path:
    with figure(path) as ax:
        for algorithm in layout.ALGORITHMS:
            if algorithm in results:
                by_k = results[algorithm]["by_k"]
                ks = sorted(by_k, key=int)
                ax.plot(ks, [by_k[k]["overall"]["tokens_per_s"] for k in ks], marker="o", label=algorithm)
        base = results.get("target_only", {}).get("overall", {}).get("tokens_per_s")
        if base:
            ax.axhline(base, color="gray", linestyle="--", label="target only")
        ax.set(xlabel="K (speculative tokens)", ylabel="tokens/s (batch 1)", title="Decode speed vs K")
        ax.legend()
    return path


def plot_acceptance(results: dict, path: Path) -> Path:
    with figure(path) as ax:
        for offset, algorithm in ((-0.2, "eagle3"), (0.2, "peagle")):
            if algorithm in results:
                rates = results[algorithm]["best"]["overall"]["acceptance_per_position"]
                ax.bar(
                    [i + 1 + offset for i in range(len(rates))],
                    [100 * r for r in rates],
                    width=0.4,
                    label=f"{algorithm} (K={results[algorithm].get('best_k', results[algorithm]['recommended_k'])})",
                )
        ax.set(xlabel="draft position", ylabel="accepted (%)", title="Acceptance per position", ylim=(0, 100))
        ax.legend()
    return path


def plot_curve(result: dict, path: Path) -> Path:
    with figure(path, (5.5, 3.5)) as ax:
        for algorithm, rows in result["curves"].items():
            tokens = [r["train_tokens"] for r in rows]
            line = ax.plot(
                tokens, [r["val_acceptance_length"] for r in rows], marker="o", label=f"{algorithm} validation"
            )
            if rows and "suite_acceptance_length" in rows[0]:
                ax.plot(
                    tokens,
                    [r["suite_acceptance_length"] for r in rows],
                    marker="s",
                    linestyle="--",
                    color=line[0].get_color(),
                    label=f"{algorithm} {result['suite']}",
                )
        ax.set(
            xscale="log",
            xlabel="training tokens (base positions)",
            ylabel="acceptance length (AL)",
            title="Drafter learning curve",
        )
        ax.legend(fontsize=8)
    return path
