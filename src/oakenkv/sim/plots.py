"""Plots of simulated throughput (matplotlib, imported only inside these functions)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from oakenkv.sim.serving import RunResult


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never opens a window (works on headless machines)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plotting needs matplotlib, which is not installed: pip install 'oakenkv[eval]' "
            "(or pip install matplotlib); the simulator itself works without it"
        ) from e
    return plt


def _plot(results: Sequence[RunResult], x_of, xlabel: str, title: str, path: Path, log2_x: bool) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system in dict.fromkeys(r.system for r in results):
        pts = sorted((x_of(r), r.tokens_per_s) for r in results if r.system == system)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
    if log2_x:
        ax.set_xscale("log", base=2)
        xs = sorted({x_of(r) for r in results})
        ax.set_xticks(xs, [str(x) for x in xs])  # plain numbers (16, 32, ...) rather than 2^4
    ax.set_xlabel(xlabel)
    ax.set_ylabel("end-to-end throughput (generated tokens/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    from oakenkv.util.paths import atomic_write

    path = Path(path)
    atomic_write(path, lambda f: fig.savefig(f, dpi=120, format=path.suffix.lstrip(".") or "png"))
    plt.close(fig)
    return path


def plot_vs_batch(results: Sequence[RunResult], path: str | Path) -> Path:
    """Throughput against requested batch, one line per system (results of one model and one length)."""
    if not results:
        raise ValueError("plot_vs_batch: no results to plot")
    r0 = results[0]
    title = f"{r0.model}, {r0.input_len}:{r0.output_len} tokens"
    return _plot(results, lambda r: r.batch, "batch size", title, Path(path), log2_x=True)


def plot_vs_length(results: Sequence[RunResult], path: str | Path) -> Path:
    """Throughput against sequence length (input + output), one line per system (one model, one batch)."""
    if not results:
        raise ValueError("plot_vs_length: no results to plot")
    r0 = results[0]
    title = f"{r0.model}, batch {r0.batch}"
    return _plot(
        results,
        lambda r: r.input_len + r.output_len,
        "sequence length (input + output tokens)",
        title,
        Path(path),
        log2_x=True,
    )
