"""Iteration-level simulation of a serving system over a request trace (sampled lengths, arrivals over time).

Each iteration: newly admitted requests are prefilled (prefill stalls decoding, no chunked prefill), then one
decode step runs for every running sequence; a sequence finishes when it has produced its output length (the
prefill produces its first token).

Admission follows the system's batching policy:
* static: a request is admitted only if its KV at its final length fits next to the running ones' final KV
  (the scheduler knows output lengths, an optimistic oracle; a real one reserves a maximum length);
* continuous (paged): admit while the current KV plus the new prompt fits; when growth overflows memory, the
  most recently admitted sequence is preempted and later recomputed (its prompt and generated tokens are
  prefilled again), as vLLM does.
Both cap the running batch at ``max_batch`` (vLLM's ``max_num_seqs``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from oakenkv.sim.hardware import SystemSpec
from oakenkv.sim.kvbytes import get_kv_format
from oakenkv.sim.serving import kv_tokens_kept, prefill_time, step_time_kv, weight_bytes_stored
from oakenkv.sim.shapes import ModelShape
from oakenkv.sim.workload import Trace


@dataclass(frozen=True)
class TraceResult:
    """Outcome of a trace. Times in seconds; latency = finish - arrival; ttft = first token - arrival."""

    system: str
    model: str
    requests: int
    generated_tokens: int
    makespan_s: float
    tokens_per_s: float
    mean_batch: float
    mean_latency_s: float
    p99_latency_s: float
    mean_ttft_s: float
    preemptions: int
    decode_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def simulate_trace(
    system: SystemSpec, model: ModelShape, trace: Trace, max_batch: int = 256, kv_format: str | None = None
) -> TraceResult:
    """Run ``trace`` through ``system`` serving ``model``; see the module docstring for the policy."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    fmt = get_kv_format(kv_format or system.kv_format)
    kv_tok = fmt.bytes_per_token(model)
    free = system.capacity - weight_bytes_stored(model)
    final = trace.input_len + trace.output_len
    too_big = kv_tok * kv_tokens_kept(model, final) > free
    if free <= 0 or np.any(too_big):
        raise ValueError(
            f"{model.name} on {system.name}: the weights or a single request of the trace do not "
            f"fit in {system.capacity / 1e9:.0f} GB"
        )
    n = len(trace)
    static = system.batching == "static"
    generated = np.zeros(n, dtype=np.int64)  # tokens produced so far
    first_tok = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    waiting: list[int] = list(range(n))  # FIFO by arrival (trace is sorted)
    running: list[int] = []
    t = 0.0
    preemptions = steps = 0
    batch_sum = 0.0

    def kv_in_use(ids: list[int], at_final: bool) -> float:
        if not ids:
            return 0.0
        idx = np.array(ids)
        length = final[idx] if at_final else trace.input_len[idx] + generated[idx]
        return float(kv_tok * kv_tokens_kept(model, length).sum())

    while waiting or running:
        # ---- admission ----
        admitted: list[int] = []
        used = kv_in_use(running, at_final=static)
        while waiting and len(running) + len(admitted) < max_batch and trace.arrival_s[waiting[0]] <= t:
            r = waiting[0]
            need = kv_tok * float(kv_tokens_kept(model, final[r] if static else trace.input_len[r] + generated[r]))
            if used + need > free:
                break
            used += need
            admitted.append(waiting.pop(0))
        if admitted:
            # a recomputed (preempted) request prefills its prompt plus what it had generated
            for r in admitted:
                plen = int(trace.input_len[r] + generated[r])
                t += prefill_time(system, model, 1, plen, fmt.name)
                if generated[r] == 0:
                    generated[r] = 1
                    first_tok[r] = t
            running.extend(admitted)
            done = [r for r in running if generated[r] >= trace.output_len[r]]
            for r in done:
                finish[r] = t
                running.remove(r)
        if not running:
            if waiting:
                t = max(t, float(trace.arrival_s[waiting[0]]))
            continue
        # ---- continuous batching: preempt the newest sequences if this step's growth overflows ----
        if not static:
            while len(running) > 1 and kv_in_use(running, False) + kv_tok * len(running) > free:
                victim = running.pop()
                waiting.insert(0, victim)
                preemptions += 1
        # ---- one decode step ----
        idx = np.array(running)
        ctx = trace.input_len[idx] + generated[idx]
        kv_tokens = float(kv_tokens_kept(model, ctx).sum())
        stored = weight_bytes_stored(model) + kv_tok * kv_tokens
        t += float(step_time_kv(system, model, fmt, len(running), np.array([kv_tokens]), stored)[0])
        steps += 1
        batch_sum += len(running)
        generated[idx] += 1
        for r in [r for r in running if generated[r] >= trace.output_len[r]]:
            finish[r] = t
            running.remove(r)

    latency = finish - trace.arrival_s
    return TraceResult(
        system=system.name,
        model=model.name,
        requests=n,
        generated_tokens=trace.generated_tokens,
        makespan_s=t,
        tokens_per_s=trace.generated_tokens / t if t > 0 else 0.0,
        mean_batch=batch_sum / steps if steps else 0.0,
        mean_latency_s=float(latency.mean()),
        p99_latency_s=float(np.percentile(latency, 99)),
        mean_ttft_s=float(np.mean(first_tok - trace.arrival_s)),
        preemptions=preemptions,
        decode_steps=steps,
    )
