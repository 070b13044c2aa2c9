"""An evaluation's arguments, checked without torch (the command line validates them before any model loads)."""

from __future__ import annotations

from typing import Any

from oakenkv.methods.registry import check_spec_with_thresholds, parse_spec

#: Zero-shot tasks and the metric each reports (``oakenkv.eval.zeroshot``).
ZEROSHOT_TASKS = {
    "piqa": ("piqa", "acc_norm"),
    "winogrande": ("winogrande", "acc"),
    "hellaswag": ("hellaswag", "acc_norm"),
}


def check_run_args(
    model: str,
    method: str,
    thresholds: Any = None,
    *,
    dataset: str | None = None,
    window: int | None = None,
    stride: int | None = None,
    chunk: int | None = None,
    text_file: Any = None,
) -> None:
    """Validate an evaluation's arguments without loading anything heavy (no torch; the model is located, not
    loaded): the method spec, a thresholds file (read, and refused when it contradicts the spec or the method is
    not Oaken), the text (a named dataset, or ``text_file``, a user's own: a regular UTF-8 file of at most 64 MiB)
    and the window sizes. Raises ValueError / FileNotFoundError naming the problem."""
    from oakenkv.assets.data import TEXTS
    from oakenkv.assets.models import locate_model

    parse_spec(method)
    if thresholds is not None:
        th, source = thresholds, "the thresholds"
        if not hasattr(th, "layer"):
            from oakenkv.calibrate.thresholds import Thresholds

            th, source = Thresholds.load(thresholds), str(thresholds)
        check_spec_with_thresholds(method, th, source)
        from oakenkv.calibrate.match import check_profile_shape

        check_profile_shape(th, model)  # (the weights are compared once the model is loaded)
    if dataset is not None and dataset not in TEXTS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(TEXTS)}")
    if text_file is not None:
        from oakenkv.assets.data import check_text_file

        check_text_file(text_file)
    for name, v, least in (("window", window, 2), ("stride", stride, 1), ("chunk", chunk, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            raise ValueError(f"{name} must be an int >= {least}, got {v!r}")
    locate_model(model)
