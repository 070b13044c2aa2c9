"""Oaken's quantization and dequantization engines (Kim et al., ISCA 2025, Section 5.3); see ``docs/hw.md``.

* :mod:`oakenkv.hw.arith` — the engines' fixed-point arithmetic: ``quantize_hw`` / ``dequantize_hw`` /
  ``encode_hw`` (the codec's "hardware arithmetic" mode; plain torch).
* :mod:`oakenkv.hw.engines` — cycle-counted, stage-by-stage Python models of both engines (no dependencies).
* :mod:`oakenkv.hw.fakequant` — ``HwOakenQuantizer`` for perplexity through
``oakenkv.methods.fakequant.FakeQuantCache``.
* :mod:`oakenkv.hw.rtl`, :mod:`oakenkv.hw.rtlsim`, :mod:`oakenkv.hw.report` — Amaranth RTL, its simulation
  against the models, Verilog and Yosys statistics (need the ``hw`` extra; imported only on use).
"""
