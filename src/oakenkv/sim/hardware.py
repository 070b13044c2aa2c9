"""Hardware specifications of the simulated serving systems (data, one table, easy to extend).

Every number here is either a datasheet/paper figure (Table 1 of Kim et al., ISCA 2025, arXiv 2503.18599) or
one of the two global efficiency factors below. To add a system, append a :class:`SystemSpec` to ``SYSTEMS``.

Units: bytes, bytes per second, FLOP per second (one multiply-accumulate = 2 FLOP), seconds.

The global efficiency factors (derivation and per-point errors in ``docs/sim.md``)
-------------------------------------------------------------------------------
``MEMORY_EFFICIENCY`` = 1.0: the fraction of peak DRAM bandwidth a streaming decode step achieves.
``COMPUTE_EFFICIENCY`` = 1.0: the fraction of peak matrix throughput prefill achieves.
Both are global (one value for every system, model and batch) and were chosen by ``validate.fit_efficiency``,
a grid search minimising the worst Figure 11 error: the optimum lies on the physical bound (1.0, 1.0), i.e.
the paper's numbers are those of an ideal roofline (its accelerator curves come from a simulator, and its vLLM
points lie at or even above the A100's bandwidth roofline). Real hardware streams at about 85-93% of peak
bandwidth: set ``memory_efficiency`` on a SystemSpec (``dataclasses.replace``) for a pessimistic estimate.

The Oaken accelerator's 270 "TFLOPS" (Table 1) counts one multiply-accumulate as one operation: 256 cores x 32
x 32 MACs x 1.0 GHz = 262.1 T MAC/s, plus 256 cores x 32 vector lanes x 1.0 GHz = 8.2 T, sum 270.3 T. In FLOP
(2 per MAC, the unit of the A100's 312 TFLOPS) the matrix units therefore give 524 TFLOP/s, which is what
``peak_flops`` stores. The LPU baseline has the same core array (the paper builds Oaken on top of it).

Oaken's quantization (1.29%) and dequantization (3.23%) engines take 4.52% of decode latency at batch 64
(Table 4); ``kv_engine_overhead`` adds that share to every decode step of the Oaken systems.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9
TB = 1e12

#: Fraction of peak memory bandwidth a streaming decode step achieves (global; see the module docstring).
MEMORY_EFFICIENCY = 1.0
#: Fraction of peak matrix throughput reached by prefill (global; see the module docstring).
COMPUTE_EFFICIENCY = 1.0

#: Oaken quantization + dequantization engines' share of decode latency at batch 64 (paper Table 4).
OAKEN_ENGINE_OVERHEAD = 0.0129 + 0.0323

#: Batching policies. "continuous": a paged, iteration-level scheduler (vLLM) keeps as many sequences running
#: as fit, so an oversized batch runs at the exact largest batch that fits. "static": the accelerator runs a
#: fixed batch compiled for power-of-two sizes, so an oversized batch falls back to the largest power of two
#: that fits (the paper's flat tails in Figure 11 repeat the previous power-of-two point exactly).
BATCHING_POLICIES = ("continuous", "static")


@dataclass(frozen=True)
class MemoryTier:
    """One memory system attached to a device.

    kind: technology name ("HBM", "LPDDR"); capacity: bytes; bandwidth: peak bytes/s.
    """

    kind: str
    capacity: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not self.kind:
            raise ValueError("MemoryTier.kind must be a non-empty name such as 'HBM' or 'LPDDR'")
        if not (self.capacity > 0 and self.bandwidth > 0):
            raise ValueError(
                f"MemoryTier {self.kind}: capacity and bandwidth must be > 0, got "
                f"{self.capacity} bytes and {self.bandwidth} bytes/s"
            )


@dataclass(frozen=True)
class SystemSpec:
    """A serving system: devices, their memory tiers, compute, KV format and scheduler.

    ``n_devices`` > 1 means pipeline parallelism over identical devices (each holds 1/n of the layers and of
    the KV cache; ``memory`` describes ONE device). ``usable_fraction`` is the share of memory the serving
    stack may use (vLLM's default ``gpu_memory_utilization`` is 0.9). ``kv_format`` names an entry of
    ``oakenkv.sim.kvbytes``.
    """

    name: str
    description: str
    peak_flops: float
    clock_hz: float
    memory: tuple[MemoryTier, ...]
    kv_format: str = "fp16"
    batching: str = "static"
    n_devices: int = 1
    usable_fraction: float = 1.0
    kv_engine_overhead: float = 0.0
    memory_efficiency: float = field(default=MEMORY_EFFICIENCY)
    compute_efficiency: float = field(default=COMPUTE_EFFICIENCY)

    def __post_init__(self) -> None:
        if not self.memory:
            raise ValueError(f"system {self.name!r}: needs at least one MemoryTier")
        if self.batching not in BATCHING_POLICIES:
            raise ValueError(
                f"system {self.name!r}: batching must be one of {BATCHING_POLICIES}, got {self.batching!r}"
            )
        if self.n_devices < 1:
            raise ValueError(f"system {self.name!r}: n_devices must be >= 1, got {self.n_devices}")
        for attr in ("usable_fraction", "memory_efficiency", "compute_efficiency"):
            v = getattr(self, attr)
            if not 0 < v <= 1:
                raise ValueError(f"system {self.name!r}: {attr} must be in (0, 1], got {v}")
        if not 0 <= self.kv_engine_overhead < 1:
            raise ValueError(
                f"system {self.name!r}: kv_engine_overhead must be in [0, 1), got {self.kv_engine_overhead}"
            )
        if self.peak_flops <= 0:
            raise ValueError(f"system {self.name!r}: peak_flops must be > 0")

    @property
    def capacity(self) -> float:
        """Usable bytes over all devices and tiers."""
        return sum(t.capacity for t in self.memory) * self.n_devices * self.usable_fraction

    @property
    def bandwidth(self) -> float:
        """Peak bytes/s of one device over all its tiers."""
        return sum(t.bandwidth for t in self.memory)

    @property
    def memory_kind(self) -> str:
        return "+".join(t.kind for t in self.memory)


_A100_HBM = MemoryTier("HBM", 80 * GB, 2.0 * TB)
_ACCEL_HBM = MemoryTier("HBM", 80 * GB, 2.0 * TB)
_ACCEL_LPDDR = MemoryTier("LPDDR", 256 * GB, 1.1 * TB)
# The hybrid splits the memory interfaces (PHYs, channels) evenly: half of Oaken-HBM's stacks next to half of
# Oaken-LPDDR's channels, so it sits between the two in capacity and bandwidth at a comparable interface cost.
_HYBRID_HBM = MemoryTier("HBM", 40 * GB, 1.0 * TB)
_HYBRID_LPDDR = MemoryTier("LPDDR", 128 * GB, 0.55 * TB)
# 256 cores x (32 x 32 matrix MACs) x 1.0 GHz x 2 FLOP/MAC; see the module docstring for why this is not
# 270e12.
_ACCEL_FLOPS = 256 * 32 * 32 * 1.0e9 * 2

SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec(
            name="vllm-a100",
            description="vLLM on one NVIDIA A100-80GB (FP16 KV, paged continuous batching)",
            peak_flops=312e12,
            clock_hz=1.41e9,
            memory=(_A100_HBM,),
            kv_format="fp16",
            batching="continuous",
            usable_fraction=0.9,
        ),
        SystemSpec(
            name="vllm-2xa100",
            description="vLLM on two A100-80GB with pipeline parallelism (the paper's setup for models > 80 GB)",
            peak_flops=312e12,
            clock_hz=1.41e9,
            memory=(_A100_HBM,),
            kv_format="fp16",
            batching="continuous",
            n_devices=2,
            usable_fraction=0.9,
        ),
        SystemSpec(
            name="lpu-hbm",
            description="LPU baseline accelerator (Oaken's core array, FP16 KV) with 80 GB HBM",
            peak_flops=_ACCEL_FLOPS,
            clock_hz=1.0e9,
            memory=(_ACCEL_HBM,),
            kv_format="fp16",
        ),
        SystemSpec(
            name="lpu-lpddr",
            description="LPU baseline accelerator (FP16 KV) with 256 GB LPDDR; the 'LPU' curve of Figure 11",
            peak_flops=_ACCEL_FLOPS,
            clock_hz=1.0e9,
            memory=(_ACCEL_LPDDR,),
            kv_format="fp16",
        ),
        SystemSpec(
            name="oaken-hbm",
            description="Oaken accelerator with 80 GB HBM (Table 1)",
            peak_flops=_ACCEL_FLOPS,
            clock_hz=1.0e9,
            memory=(_ACCEL_HBM,),
            kv_format="oaken",
            kv_engine_overhead=OAKEN_ENGINE_OVERHEAD,
        ),
        SystemSpec(
            name="oaken-lpddr",
            description="Oaken accelerator with 256 GB LPDDR (Table 1)",
            peak_flops=_ACCEL_FLOPS,
            clock_hz=1.0e9,
            memory=(_ACCEL_LPDDR,),
            kv_format="oaken",
            kv_engine_overhead=OAKEN_ENGINE_OVERHEAD,
        ),
        SystemSpec(
            name="oaken-hybrid",
            description="Oaken accelerator with half of each memory system (40 GB HBM at 1.0 TB/s + 128 GB "
            "LPDDR at 0.55 TB/s, data interleaved in proportion to bandwidth); a configuration of this "
            "project, not of the paper",
            peak_flops=_ACCEL_FLOPS,
            clock_hz=1.0e9,
            memory=(_HYBRID_HBM, _HYBRID_LPDDR),
            kv_format="oaken",
            kv_engine_overhead=OAKEN_ENGINE_OVERHEAD,
        ),
    )
}


def get_system(name: str) -> SystemSpec:
    """Return the system called ``name`` (case-insensitive), with a helpful error listing the known ones."""
    key = name.strip().lower()
    if key not in SYSTEMS:
        raise KeyError(f"unknown system {name!r}; known systems: {', '.join(SYSTEMS)}")
    return SYSTEMS[key]
