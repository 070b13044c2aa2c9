"""The paper's throughput numbers (Kim et al., ISCA 2025), as data for validation.

Copied from ``../shared/reference/oaken-paper-figures.md`` (values read from the paper's plots, about +-1% of
full scale). Keys are (model, system) with the simulator's names; values are tokens/s at ``FIG11_BATCHES``.
"""

from __future__ import annotations

#: Figure 11: end-to-end throughput, 1K input : 1K output, whole batch prefilled then decoded.
FIG11_BATCHES = (16, 32, 64, 128, 256)
FIG11_INPUT = 1024
FIG11_OUTPUT = 1024
FIG11: dict[tuple[str, str], tuple[float, ...]] = {
    ("llama2-7b", "vllm-a100"): (1261, 1631, 1792, 1744, 1760),
    ("llama2-7b", "lpu-lpddr"): (682, 907, 1100, 1245, 1245),
    ("llama2-7b", "oaken-lpddr"): (971, 1551, 2227, 2854, 3305),
    ("llama2-7b", "oaken-hbm"): (1696, 2726, 3901, 4995, 4995),
    ("llama2-13b", "vllm-a100"): (751, 827, 915, 967, 928),
    ("llama2-13b", "lpu-lpddr"): (380, 532, 660, 756, 756),
    ("llama2-13b", "oaken-lpddr"): (517, 854, 1257, 1659, 1966),
    ("llama2-13b", "oaken-hbm"): (909, 1498, 2215, 2215, 2215),
}
#: Points where the paper's curve is flat because the batch no longer fits (the simulator must not run them).
FIG11_SATURATED: dict[tuple[str, str], tuple[int, ...]] = {
    ("llama2-7b", "lpu-lpddr"): (256,),
    ("llama2-7b", "oaken-hbm"): (256,),
    ("llama2-13b", "lpu-lpddr"): (256,),
    ("llama2-13b", "oaken-hbm"): (128, 256),
}

#: Figure 5(b): Llama2-13B on an LPDDR accelerator (the LPU core array with 256 GB LPDDR), FP16 vs 4-bit KV.
#: The reference lists batches 1/4/8/16/32/64/128/256 but only seven values per curve; the values match the
#: roofline (and Figure 11's LPU / Oaken-LPDDR curves, e.g. 518 / 853 / 1260 / 1657 / 1966 at 16..256) only
#: for batches 1/8/16/32/64/128/256, so that is the mapping used here. None = out of memory.
FIG5B_BATCHES = (1, 8, 16, 32, 64, 128, 256)
FIG5B: dict[str, tuple[float | None, ...]] = {
    "lpu-lpddr": (39, 238, 374, 524, 654, 742, None),  # no quantization
    "oaken-lpddr": (39, 290, 518, 853, 1260, 1657, 1966),  # 4-bit KV
}

#: Headline: at batch 256, Oaken-LPDDR averages 1.79x vLLM's throughput over the evaluated models.
HEADLINE_OAKEN_LPDDR_OVER_VLLM = 1.79
