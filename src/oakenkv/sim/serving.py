"""The serving model: prefill and decode step times from a roofline over weights, KV traffic and compute.

A decode step of a batch of B sequences at context c (per sequence) costs::

    memory  = weights read (attention + LM head + the distinct experts the batch routes to)
              + B x KV bytes/token x (min(c, window) + 1)   # read every cached K/V once, write the new token
    compute = 2 x B x (active parameters + attention MACs over min(c, window))
    time    = max(memory / (bandwidth x memory_efficiency), compute / (peak FLOP/s x compute_efficiency))
              / (1 - kv_engine_overhead)

Prefill of one sequence of S tokens is the same roofline with S tokens of compute and one read of the weights
(prefill runs sequence by sequence, as memory-limited accelerators do; it is compute-bound either way).

End-to-end throughput for a fixed input:output workload (Figure 11's definition) is generated tokens /
(prefill time of the whole batch + the sum of the decode steps), where the decode context grows from input+1
to input+output-1 (the prefill emits the first token). A batch that does not fit runs at the largest batch
that does (see ``hardware.BATCHING_POLICIES``); capacity counts the weights plus the whole batch's KV at its
final length.

Memory tiers (the hybrid system) hold data interleaved in proportion to their bandwidth, limited by each
tier's capacity (water-filling); a step reads each tier's share in parallel. Pipeline parallelism over n
devices: each device holds 1/n of the layers; with n micro-batches in flight every device reads its weights
once per micro-batch and its share of each micro-batch's KV, so per step the traffic per device is W + KV / n.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from oakenkv.sim.hardware import SystemSpec
from oakenkv.sim.kvbytes import KVFormat, get_kv_format
from oakenkv.sim.shapes import ModelShape
from oakenkv.util.exact import is_int


def _is_count(v: object) -> bool:
    """An int (not a bool) or a numpy integer: a batch or a length (floats and bools were taken and run)."""
    return is_int(v) or isinstance(v, np.integer)


def _count(name: str, v: object) -> int:
    """``v`` as a plain int when it is a count >= 1 (:func:`_is_count`), else ValueError naming ``name``."""
    if not _is_count(v) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)


WEIGHT_BYTES = 2  # FP16 weights on every system (the paper quantizes only the KV cache)


@dataclass(frozen=True)
class RunResult:
    """One simulated run of a fixed input:output workload. Times in seconds, sizes in bytes."""

    system: str
    model: str
    kv_format: str
    batch: int  # requested batch
    batch_run: int  # batch actually run (0: not even one sequence fits)
    max_batch: int  # largest batch the scheduler keeps running (policy_max_batch), before power-of-two rounding
    input_len: int
    output_len: int
    tokens_per_s: float
    prefill_s: float
    decode_s: float
    kv_bytes_per_token: float
    kv_bits_per_value: float
    weight_bytes: float
    memory_used: float  # weights + resident KV of batch_run (final length, or average if staggered)
    capacity: float

    def to_dict(self) -> dict:
        return asdict(self)


def _check_lengths(input_len: int, output_len: int) -> None:
    if not (_is_count(input_len) and _is_count(output_len)) or input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be ints >= 1, got {input_len!r} and {output_len!r}")


def weight_bytes_stored(model: ModelShape) -> float:
    return model.total_params * WEIGHT_BYTES


def expected_experts(model: ModelShape, tokens: float | np.ndarray) -> float | np.ndarray:
    """Expected distinct experts per layer touched by ``tokens`` tokens under uniform top-k routing."""
    if model.n_experts == 1:
        return 1.0 if np.isscalar(tokens) else np.ones_like(tokens, dtype=float)
    e, k = model.n_experts, model.experts_per_token
    return e * (1.0 - (1.0 - k / e) ** np.asarray(tokens, dtype=float))


def weight_bytes_read(model: ModelShape, tokens: float | np.ndarray) -> float | np.ndarray:
    """Weight bytes one forward pass over ``tokens`` tokens reads: all attention weights, the LM head (the
    input embedding is a gather of a few rows, ignored) and the distinct experts the tokens route to."""
    dense = model.n_layers * model.attn_params_per_layer + model.vocab * model.d_model
    experts = model.n_layers * model.expert_params * expected_experts(model, tokens)
    return (dense + experts) * WEIGHT_BYTES


def kv_tokens_kept(model: ModelShape, ctx: int | np.ndarray) -> int | np.ndarray:
    """Tokens the KV cache holds at context ``ctx`` (a sliding window caps it)."""
    return ctx if model.sliding_window is None else np.minimum(ctx, model.sliding_window)


def tier_shares(system: SystemSpec, stored_per_device: float) -> np.ndarray:
    """Fraction of the data in each memory tier: proportional to bandwidth, capped by capacity (water-filling).

    Returns shape [n_tiers], summing to 1 (when the data fits; callers check capacity first).
    """
    bw = np.array([t.bandwidth for t in system.memory], dtype=float)
    cap = np.array([t.capacity * system.usable_fraction for t in system.memory], dtype=float)
    if len(bw) == 1 or stored_per_device <= 0:
        return np.ones(len(bw)) / len(bw) if stored_per_device <= 0 else np.ones(1)
    share = np.zeros(len(bw))
    free = np.ones(len(bw), dtype=bool)
    remaining = 1.0
    for _ in range(len(bw)):
        prop = bw * free / (bw * free).sum() * remaining
        over = free & (prop * stored_per_device > cap)
        if not over.any():
            share[free] = prop[free]
            break
        share[over] = cap[over] / stored_per_device
        remaining -= share[over].sum()
        free &= ~over
    return share


def memory_time(system: SystemSpec, bytes_per_device: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """Seconds to stream ``bytes_per_device`` (any shape) from the tiers in parallel."""
    bw = np.array([t.bandwidth for t in system.memory], dtype=float) * system.memory_efficiency
    per_tier = np.asarray(bytes_per_device, dtype=float)[..., None] * shares / bw
    return per_tier.max(axis=-1)


def _kv_format(system: SystemSpec, kv_format: str | None) -> KVFormat:
    return get_kv_format(kv_format or system.kv_format)


def memory_needed(model: ModelShape, fmt: KVFormat, batch: int, seq_len: int) -> float:
    """Bytes of weights plus the KV of ``batch`` sequences of ``seq_len`` tokens."""
    return float(weight_bytes_stored(model) + batch * fmt.bytes_per_token(model) * kv_tokens_kept(model, seq_len))


def max_batch(system: SystemSpec, model: ModelShape, seq_len: int, kv_format: str | None = None) -> int:
    """Largest number of sequences of final length ``seq_len`` whose weights + KV fit (0 if none)."""
    _count("seq_len", seq_len)
    fmt = _kv_format(system, kv_format)
    free = system.capacity - weight_bytes_stored(model)
    if free <= 0:
        return 0
    return int(free // (fmt.bytes_per_token(model) * float(kv_tokens_kept(model, seq_len))))


def policy_max_batch(
    system: SystemSpec, model: ModelShape, input_len: int, output_len: int, kv_format: str | None = None
) -> int:
    """Largest batch the system's scheduler can keep running for an input_len:output_len workload.

    static: the whole batch at its final length (input + output) must fit. continuous (paged, on-demand
    blocks): once more requests wait than fit, sequences are staggered in steady state and their contexts are
    spread uniformly over [input, input + output], so the resident KV is that of the average length input +
    output / 2.
    """
    final = input_len + output_len
    if system.batching == "continuous":
        return max_batch(system, model, input_len + output_len // 2, kv_format)
    return max_batch(system, model, final, kv_format)


def batch_to_run(system: SystemSpec, requested: int, fits: int) -> int:
    """Apply the system's batching policy to a requested batch given the policy's largest batch that fits."""
    _count("batch", requested)
    if requested <= fits:
        return requested
    if fits < 1:
        return 0
    if system.batching == "continuous":
        return fits
    return 1 << (fits.bit_length() - 1)  # static: the largest power of two that fits


def step_time_kv(
    system: SystemSpec,
    model: ModelShape,
    fmt: KVFormat,
    batch: int | np.ndarray,
    kv_tokens: np.ndarray,
    stored_bytes: float,
) -> np.ndarray:
    """Seconds of decode steps given the batch size and the total KV tokens the batch attends to.

    batch: sequences in the step (scalar or shape [steps]); kv_tokens: shape [steps], the sum over the batch
    of the cached tokens each sequence reads (already capped by any sliding window); stored_bytes: resident
    weights + KV over all devices (decides the tier placement).
    """
    kv_tokens = np.asarray(kv_tokens, dtype=float)
    batch = np.asarray(batch, dtype=float)
    kv_tok = fmt.bytes_per_token(model)
    n = system.n_devices
    shares = tier_shares(system, stored_bytes / n)
    kv_bytes = kv_tok * (kv_tokens + batch)  # read the cache, write each sequence's new token
    t_mem = memory_time(system, weight_bytes_read(model, batch) + kv_bytes / n, shares)
    attn_macs = model.n_layers * model.n_heads * model.head_dim * 2 * kv_tokens
    flops = 2.0 * (batch * model.active_params + attn_macs)
    t_cmp = flops / (system.peak_flops * system.compute_efficiency * n)
    # the (de)quantization engines work only on the system's own KV format (Oaken engines on Oaken KV)
    overhead = system.kv_engine_overhead if fmt.name == system.kv_format else 0.0
    return np.maximum(t_mem, t_cmp) / (1.0 - overhead)


def decode_step_times(
    system: SystemSpec,
    model: ModelShape,
    batch: int,
    ctx: np.ndarray,
    kv_format: str | None = None,
    final_len: int | None = None,
) -> np.ndarray:
    """Seconds of each decode step of ``batch`` sequences at contexts ``ctx`` (float [steps], tokens attended).

    ``final_len`` sets how much KV is resident (for tier placement); defaults to the largest context.
    """
    fmt = _kv_format(system, kv_format)
    ctx = np.asarray(ctx, dtype=float)
    final = int(ctx.max()) if final_len is None else int(final_len)
    stored = memory_needed(model, fmt, batch, final)
    return step_time_kv(system, model, fmt, batch, batch * kv_tokens_kept(model, ctx), stored)


def prefill_time(
    system: SystemSpec,
    model: ModelShape,
    batch: int,
    input_len: int,
    kv_format: str | None = None,
    final_len: int | None = None,
) -> float:
    """Seconds to prefill ``batch`` prompts of ``input_len`` tokens (one sequence at a time)."""
    fmt = _kv_format(system, kv_format)
    n = system.n_devices
    final = input_len if final_len is None else final_len
    shares = tier_shares(system, memory_needed(model, fmt, batch, final) / n)
    avg_attended = (kv_tokens_kept(model, input_len) + 1) / 2  # causal: token i attends to i tokens
    attn_macs = model.n_layers * model.n_heads * model.head_dim * 2 * avg_attended
    flops = 2.0 * input_len * (model.active_params + attn_macs)
    t_cmp = flops / (system.peak_flops * system.compute_efficiency * n)
    bytes_dev = weight_bytes_read(model, input_len) + fmt.bytes_per_token(model) * input_len / n
    t_mem = float(memory_time(system, np.array([bytes_dev]), shares)[0])
    return float(batch * max(t_cmp, t_mem))


def simulate(
    system: SystemSpec,
    model: ModelShape,
    batch: int,
    input_len: int,
    output_len: int,
    kv_format: str | None = None,
) -> RunResult:
    """End-to-end run of ``batch`` requests of input_len:output_len (whole batch prefilled, then decoded)."""
    _check_lengths(input_len, output_len)
    batch, input_len, output_len = _count("batch", batch), int(input_len), int(output_len)  # (numpy ints: plain)
    fmt = _kv_format(system, kv_format)
    final = input_len + output_len
    fits = policy_max_batch(system, model, input_len, output_len, fmt.name)
    run = batch_to_run(system, batch, fits)
    kv_tok = fmt.bytes_per_token(model)
    common = dict(
        system=system.name,
        model=model.name,
        kv_format=fmt.name,
        batch=batch,
        batch_run=run,
        max_batch=fits,
        input_len=input_len,
        output_len=output_len,
        kv_bytes_per_token=kv_tok,
        kv_bits_per_value=fmt.bits_per_value(model),
        weight_bytes=weight_bytes_stored(model),
        capacity=system.capacity,
    )
    if run == 0:
        return RunResult(
            tokens_per_s=0.0,
            prefill_s=float("nan"),
            decode_s=float("nan"),
            memory_used=memory_needed(model, fmt, 1, final),
            **common,
        )
    # a batch that fits runs to its final length together; a larger one under continuous batching is staggered,
    # so its resident KV is that of the average length (see policy_max_batch)
    staggered = system.batching == "continuous" and run > max_batch(system, model, final, fmt.name)
    resident_len = input_len + output_len // 2 if staggered else final
    t_pre = prefill_time(system, model, run, input_len, fmt.name, final)
    ctx = np.arange(input_len + 1, final, dtype=float)  # output_len - 1 decode steps
    t_dec = float(decode_step_times(system, model, run, ctx, fmt.name, final).sum()) if len(ctx) else 0.0
    return RunResult(
        tokens_per_s=float(run * output_len / (t_pre + t_dec)),
        prefill_s=t_pre,
        decode_s=t_dec,
        memory_used=memory_needed(model, fmt, run, resident_len),
        **common,
    )


def max_context(system: SystemSpec, model: ModelShape, batch: int, kv_format: str | None = None) -> int:
    """Longest sequence (input + output tokens) each of ``batch`` sequences can reach before memory runs out.

    Returns 0 when the weights alone do not fit. A sliding-window model is unbounded by KV (returns the
    model's maximum position when the window fits).
    """
    _count("batch", batch)
    fmt = _kv_format(system, kv_format)
    free = system.capacity - weight_bytes_stored(model)
    if free <= 0:
        return 0
    tokens = int(free // (batch * fmt.bytes_per_token(model)))
    if model.sliding_window is not None and tokens >= model.sliding_window:
        return max(model.max_position, tokens)
    return tokens
