"""Memory configuration advisor: HBM, LPDDR or hybrid for a model and a workload, with the numbers behind it.

The rule (stated so that a reader can check a recommendation by hand):

1. A candidate must run the requested batch at full size (no fallback to a smaller batch) and meet every goal
   given: ``min_tokens_per_s`` (end-to-end throughput at the batch) and ``min_context`` (longest sequence each
   of the batch's sequences can reach).
2. With a throughput goal, the cheapest-memory candidate that meets it wins, in the order LPDDR < hybrid < HBM
   (LPDDR costs several times less per GB than HBM, which is the paper's case for LPDDR); without one, the
   fastest candidate wins.
3. If no candidate meets everything, the advisor names the one that comes closest (the largest ratio of
   achieved to required on the worst goal) and says which goal fails and by how much.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from oakenkv.sim.hardware import SYSTEMS, SystemSpec
from oakenkv.sim.serving import max_context, simulate
from oakenkv.sim.shapes import ModelShape

#: Systems the advisor compares by default (one Oaken accelerator per memory configuration).
DEFAULT_CANDIDATES = ("oaken-hbm", "oaken-lpddr", "oaken-hybrid")
#: Relative memory cost order used to break ties (lower first); see the module docstring.
_COST_ORDER = {"LPDDR": 0, "HBM+LPDDR": 1, "LPDDR+HBM": 1, "HBM": 2}


@dataclass(frozen=True)
class Candidate:
    """The numbers behind one system's verdict."""

    system: str
    memory: str
    capacity_gb: float
    bandwidth_tb_s: float
    batch_run: int
    max_batch: int
    tokens_per_s: float
    max_context: int
    meets: bool
    shortfall: str  # empty when every goal is met


@dataclass(frozen=True)
class Advice:
    model: str
    batch: int
    input_len: int
    output_len: int
    min_tokens_per_s: float | None
    min_context: int | None
    recommended: str
    reason: str
    candidates: list[Candidate] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _evaluate(
    system: SystemSpec,
    model: ModelShape,
    batch: int,
    input_len: int,
    output_len: int,
    min_tps: float | None,
    min_ctx: int | None,
) -> tuple[Candidate, float]:
    r = simulate(system, model, batch, input_len, output_len)
    ctx = max_context(system, model, batch)
    ratios = [r.batch_run / batch]
    short = []
    if r.batch_run < batch:
        short.append(f"only {r.batch_run} of {batch} sequences fit")
    if min_tps is not None:
        ratios.append(r.tokens_per_s / min_tps)
        if r.tokens_per_s < min_tps:
            short.append(f"{r.tokens_per_s:.0f} < {min_tps:.0f} tokens/s")
    if min_ctx is not None:
        ratios.append(ctx / min_ctx)
        if ctx < min_ctx:
            short.append(f"context {ctx} < {min_ctx} tokens")
    cand = Candidate(
        system=system.name,
        memory=system.memory_kind,
        capacity_gb=system.capacity / 1e9,
        bandwidth_tb_s=system.bandwidth / 1e12,
        batch_run=r.batch_run,
        max_batch=r.max_batch,
        tokens_per_s=r.tokens_per_s,
        max_context=ctx,
        meets=not short,
        shortfall="; ".join(short),
    )
    return cand, min(ratios)


def advise(
    model: ModelShape,
    batch: int,
    input_len: int,
    output_len: int,
    min_tokens_per_s: float | None = None,
    min_context: int | None = None,
    systems: tuple[str, ...] = DEFAULT_CANDIDATES,
) -> Advice:
    """Recommend a memory configuration for serving ``model`` at ``batch`` input_len:output_len requests."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if min_tokens_per_s is not None and min_tokens_per_s <= 0:
        raise ValueError(f"min_tokens_per_s must be > 0, got {min_tokens_per_s}")
    if min_context is not None and min_context < 1:
        raise ValueError(f"min_context must be >= 1, got {min_context}")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise KeyError(f"unknown systems {unknown}; known systems: {', '.join(SYSTEMS)}")
    evaluated = [
        _evaluate(SYSTEMS[s], model, batch, input_len, output_len, min_tokens_per_s, min_context) for s in systems
    ]
    cands = [c for c, _ in evaluated]
    ok = [c for c in cands if c.meets]
    if ok and min_tokens_per_s is not None:
        best = min(ok, key=lambda c: (_COST_ORDER.get(c.memory, 9), -c.tokens_per_s))
        reason = (
            f"{best.system} ({best.memory}) is the cheapest memory that meets every goal: "
            f"{best.tokens_per_s:.0f} tokens/s at batch {batch}, context up to {best.max_context}"
        )
    elif ok:
        best = max(ok, key=lambda c: c.tokens_per_s)
        reason = (
            f"{best.system} ({best.memory}) is the fastest configuration that runs batch {batch}: "
            f"{best.tokens_per_s:.0f} tokens/s, context up to {best.max_context}"
        )
    else:
        best = max(evaluated, key=lambda e: e[1])[0]
        reason = f"no configuration meets every goal; {best.system} comes closest ({best.shortfall})"
    return Advice(
        model=model.name,
        batch=batch,
        input_len=input_len,
        output_len=output_len,
        min_tokens_per_s=min_tokens_per_s,
        min_context=min_context,
        recommended=best.system,
        reason=reason,
        candidates=cands,
    )


def context_table(model: ModelShape, batches: tuple[int, ...], systems: tuple[str, ...]) -> dict[str, dict]:
    """Longest context (tokens per sequence) each system can hold at each batch: {system: {batch: tokens}}."""
    return {s: {b: max_context(SYSTEMS[s], model, b) for b in batches} for s in systems}
