"""Compare the simulator with the paper and fit the global efficiency factors (reproducibly).

``figure11_table()`` and ``figure5b_table()`` give per-point paper / simulated / error rows;
``fit_efficiency()`` is the grid search that chose ``hardware.MEMORY_EFFICIENCY`` and
``hardware.COMPUTE_EFFICIENCY`` (minimise the worst Figure 11 error, ties broken by RMS error).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from oakenkv.sim import paper
from oakenkv.sim.hardware import SYSTEMS, SystemSpec
from oakenkv.sim.serving import simulate
from oakenkv.sim.shapes import MODELS, get_model


@dataclass(frozen=True)
class Point:
    figure: str
    model: str
    system: str
    batch: int
    paper: float | None  # None: the paper reports out of memory
    simulated: float
    batch_run: int

    @property
    def error_pct(self) -> float | None:
        return None if self.paper is None else (self.simulated / self.paper - 1) * 100


def _systems(overrides: dict | None) -> dict[str, SystemSpec]:
    if not overrides:
        return SYSTEMS
    return {k: dataclasses.replace(v, **overrides) for k, v in SYSTEMS.items()}


def figure11_table(overrides: dict | None = None) -> list[Point]:
    """Every Figure 11 point; ``overrides`` replaces SystemSpec fields on every system (for fitting)."""
    systems = _systems(overrides)
    rows = []
    for (model, system), values in paper.FIG11.items():
        for batch, ref in zip(paper.FIG11_BATCHES, values, strict=True):
            r = simulate(systems[system], get_model(model), batch, paper.FIG11_INPUT, paper.FIG11_OUTPUT)
            rows.append(Point("11", model, system, batch, ref, r.tokens_per_s, r.batch_run))
    return rows


def figure5b_table(overrides: dict | None = None) -> list[Point]:
    systems = _systems(overrides)
    rows = []
    for system, values in paper.FIG5B.items():
        for batch, ref in zip(paper.FIG5B_BATCHES, values, strict=True):
            r = simulate(systems[system], get_model("llama2-13b"), batch, 1024, 1024)
            rows.append(Point("5b", "llama2-13b", system, batch, ref, r.tokens_per_s, r.batch_run))
    return rows


def error_summary(rows: Iterable[Point]) -> tuple[float, float]:
    """(worst absolute error %, RMS error %) over the rows with a paper value."""
    errs = np.array([p.error_pct for p in rows if p.error_pct is not None])
    return float(np.abs(errs).max()), float(np.sqrt(np.mean(errs**2)))


def fit_efficiency(
    memory_grid: Iterable[float] = np.round(np.arange(0.80, 1.001, 0.01), 2),
    compute_grid: Iterable[float] = np.round(np.arange(0.40, 1.001, 0.05), 2),
) -> list[tuple[float, float, float, float]]:
    """Grid-search the two global factors on Figure 11. Returns (worst %, rms %, memory_eff,
    compute_eff), best
    first. The same pair applies to every system: there is no per-system or per-model fitting."""
    out = []
    for me in memory_grid:
        for ce in compute_grid:
            worst, rms = error_summary(
                figure11_table({"memory_efficiency": float(me), "compute_efficiency": float(ce)})
            )
            out.append((worst, rms, float(me), float(ce)))
    return sorted(out)


def headline_ratio(batch: int = 256) -> dict[str, float]:
    """Oaken-LPDDR / vLLM throughput at ``batch`` for each paper model (two A100s when weights exceed one
    GPU's
    usable memory, as in the paper), plus their arithmetic mean under key 'mean'."""
    from oakenkv.sim.serving import weight_bytes_stored

    ratios = {}
    for name in paper_models():
        model = MODELS[name]
        one = SYSTEMS["vllm-a100"]
        gpu = one if weight_bytes_stored(model) < one.capacity else SYSTEMS["vllm-2xa100"]
        g = simulate(gpu, model, batch, 1024, 1024).tokens_per_s
        o = simulate(SYSTEMS["oaken-lpddr"], model, batch, 1024, 1024).tokens_per_s
        ratios[name] = o / g if g > 0 else float("inf")
    ratios["mean"] = float(np.mean(list(ratios.values())))
    return ratios


def paper_models() -> tuple[str, ...]:
    from oakenkv.sim.shapes import PAPER_MODELS

    return PAPER_MODELS


def format_table(rows: Iterable[Point]) -> str:
    """Markdown table: model, system, batch, paper, simulated, error %, batch actually run."""
    lines = [
        "| fig | model | system | batch | paper | simulated | error % | batch run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in rows:
        ref = "OOM" if p.paper is None else f"{p.paper:.0f}"
        err = "-" if p.error_pct is None else f"{p.error_pct:+.1f}"
        lines.append(
            f"| {p.figure} | {p.model} | {p.system} | {p.batch} | {ref} | {p.simulated:.0f} | {err} | {p.batch_run} |"
        )
    return "\n".join(lines)
