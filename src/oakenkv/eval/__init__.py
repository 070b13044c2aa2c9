"""Accuracy evaluation of KV-cache methods: perplexity, zero-shot tasks, reports.

- :mod:`~oakenkv.eval.cache`: the fake-quant transformers cache the evaluation runs every method through.
- :mod:`~oakenkv.eval.calibration`: statistics of the cache tensors on calibration text (never WikiText-2 by
  default) from which thresholds and baseline ranges are derived.
- :mod:`~oakenkv.eval.methods`: the registry of methods (Oaken variants and baselines) behind one interface.
- :mod:`~oakenkv.eval.ppl`, :mod:`~oakenkv.eval.zeroshot`, :mod:`~oakenkv.eval.report`: the three commands.
"""
