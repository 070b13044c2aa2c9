"""Accuracy evaluation of KV-cache methods: perplexity, zero-shot tasks, reports.

- :mod:`~oakenkv.methods.fakequant`: the fake-quant transformers cache the evaluation runs every method through.
- :mod:`~oakenkv.calibrate.ranges`: statistics of the cache tensors on calibration text (never WikiText-2 by
  default) from which thresholds and baseline ranges are derived.
- :mod:`~oakenkv.methods.registry`: the registry of methods (Oaken variants and baselines) behind one interface.
- :mod:`~oakenkv.eval.ppl`, :mod:`~oakenkv.eval.zeroshot`, :mod:`~oakenkv.eval.report`: the three commands.
"""
