"""Perplexity of a model whose KV cache goes through a method, on fixed token windows (WikiText-2 test).

The paper's protocol (Table 2): windows of 2048 tokens with stride 2048, each window evaluated independently
from an empty cache; the loss is the mean negative log-likelihood of tokens 2..W of each window given the
previous ones, ``ppl = exp(sum NLL / number of predicted tokens)``.

By default a window is one forward pass (a prefill): every key and value the attention reads has been written
to the method's cache first, so prefill attention reads quantized K/V too, as in the paper's harness. With
``chunk``, the window is fed ``chunk`` tokens at a time through the same cache (``chunk=1`` is token-by-token
decoding); only methods that keep state (KIVI's and quanto's fp16 residual windows) give different results.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from oakenkv.calibrate.spec import check_positions
from oakenkv.calibrate.thresholds import weights_digest
from oakenkv.eval.args import check_run_args
from oakenkv.methods.base import BitCounter
from oakenkv.methods.fakequant import stored_bits
from oakenkv.util.numerics import cpu_numerics
from oakenkv.util.paths import atomic_write


@dataclass
class PplResult:
    """Perplexity of one method on one model (the JSON written by ``oakenkv eval ppl``)."""

    method: str
    ppl: float
    effective_bits: float
    tokens: int
    windows: int
    model: str = ""
    window: int = 0
    stride: int = 0
    chunk: int | None = None
    nll: float = 0.0
    seconds: float = 0.0
    #: the evaluation text: a named dataset (``oakenkv.assets.data.TEXTS``), or ``"file"`` for ``--text-file``
    #: (``extra["text_file"]``: its path, size and SHA-256)
    dataset: str = "wikitext2"
    #: every window starts with the tokenizer's BOS token (``oakenkv.assets.data.token_windows``; Gemma: yes)
    bos: bool = False
    #: summed NLL of each window, in order (each window predicts ``tokens / windows`` tokens): lets two methods
    #: run on the same windows be compared window by window (``oakenkv.eval.report.paired_delta``)
    window_nll: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "ppl", **asdict(self)}


def _check_checkpoint(state: dict[str, Any], ckpt: Path, windows: int) -> None:
    """Refuse a checkpoint of this run whose numbers are not what the run writes (hand-edited, damaged): exact types,
    finite, at most ``windows`` window NLLs."""
    from oakenkv.util.exact import is_int, is_number

    nll = state.get("window_nll")
    ok = isinstance(nll, list) and len(nll) <= windows and all(is_number(x) and math.isfinite(x) for x in nll)
    ok = ok and is_number(state.get("bits")) and math.isfinite(state["bits"]) and state["bits"] >= 0
    ok = ok and is_int(state.get("values")) and state["values"] >= 0
    ok = ok and is_number(state.get("seconds")) and math.isfinite(state["seconds"])
    if not ok:
        raise ValueError(f"{ckpt} is a damaged checkpoint of this run (not the numbers a run writes); delete it")


def window_nll(model: Any, ids: torch.Tensor, cache: Any, chunk: int | None = None) -> tuple[float, int]:
    """Summed NLL of ``ids[1:]`` given the prefix, through ``cache``; returns ``(nll_sum, predicted tokens)``.

    Args:
        ids: int64 ``[S]`` token ids of one window.
        cache: a fresh (empty) transformers cache.
        chunk: feed ``chunk`` tokens per forward call (default: the whole window at once).
    """
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(f"a window must be a 1-D tensor of >= 2 token ids, got shape {tuple(ids.shape)}")
    s = ids.numel()
    step = s if chunk is None else chunk
    if step < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    from oakenkv.util.compat import cache_kwargs

    nll = 0.0
    kw = cache_kwargs(model, cache)
    with torch.no_grad():
        for a in range(0, s - 1, step):
            b = min(a + step, s - 1)  # the last token is only a target
            inp = ids[a:b][None]
            pos = torch.arange(a, b)[None]
            out = model(input_ids=inp, use_cache=True, position_ids=pos, **kw)
            logits = out.logits[0].float()  # [b - a, V]
            nll += float(torch.nn.functional.cross_entropy(logits, ids[a + 1 : b + 1], reduction="sum"))
    return nll, s - 1


class NothingQuantizedWarning(UserWarning):
    """A quantization method left every key and value of the evaluated windows at full precision (its residual
    window covered them): the perplexity printed is full precision's, not the method's."""


def perplexity(
    model: Any,
    windows: torch.Tensor,
    method: Any,
    *,
    chunk: int | None = None,
    progress: bool = False,
    model_name: str = "",
    checkpoint: str | Path | None = None,
) -> PplResult:
    """Perplexity of ``model`` with ``method``'s cache over ``windows``.

    Args:
        windows: int64 ``[N, S]`` token windows (``oakenkv.assets.data.token_windows``).
        method: an :class:`~oakenkv.methods.registry.Method`.
        chunk: tokens per forward call (module doc).
        checkpoint: a JSON file rewritten after every window (per-window NLLs, stored bits, time). If it exists
            when the run starts and belongs to the same run, the run resumes after its last window (the result is
            the same as an uninterrupted run's: windows are independent); if it belongs to another run,
            ``ValueError``. Removed when the run completes. A run is identified by content: the model's weights
            (:func:`oakenkv.calibrate.thresholds.weights_digest`), the windows' tokens, the method's settings and what
            it was calibrated with (its thresholds' and ranges' digests in ``method.extra``), the chunking, and
            torch's CPU kernels (``oakenkv.util.numerics``: other kernels round differently); the
            names of the method and model only label it. Re-profiling the thresholds or changing the model at the
            same path between an interrupt and the rerun refuses the checkpoint instead of mixing two runs.
    """
    if windows.dim() != 2 or windows.dtype != torch.int64:
        raise ValueError(f"windows must be int64 [N, S], got {windows.dtype} {tuple(windows.shape)}")
    if getattr(method, "model", None) is not None:
        model = method.model  # oaken-plus: the copy with its transforms folded in
    per_window: list[float] = []
    bits = BitCounter()
    spent = 0.0
    weights = weights_digest(model)
    numerics = cpu_numerics()
    ident = {
        "method": method.name,
        "model": model_name,
        "model_weights": weights,
        "chunk": chunk,
        "settings_sha256": hashlib.sha256(
            json.dumps([method.params, method.extra], sort_keys=True, default=str).encode()
        ).hexdigest(),
        "windows_sha256": hashlib.sha256(windows.contiguous().numpy().tobytes()).hexdigest(),
        # windows computed with other CPU kernels are not bit-comparable (oakenkv.util.numerics): never mixed
        "torch_cpu_capability": numerics["torch_cpu_capability"],
    }
    ckpt = None if checkpoint is None else Path(checkpoint)
    if ckpt is not None and (ckpt.exists() or ckpt.is_symlink()):
        from oakenkv.util.paths import MAX_RESULT_BYTES, read_text_capped

        try:  # (a regular file of bounded size: a pipe in its place would block the run)
            state = json.loads(read_text_capped(ckpt, "checkpoint", MAX_RESULT_BYTES))
        except (OSError, ValueError, RecursionError):  # unreadable, not a file, not UTF-8, not JSON
            state = None
        same = isinstance(state, dict) and state.get("kind") == "ppl_checkpoint"
        same = same and all(state.get(k) == v for k, v in ident.items())
        if not same:
            differ = [k for k, v in ident.items() if isinstance(state, dict) and state.get(k) != v]
            raise ValueError(
                f"{ckpt} is not a checkpoint of this run (method {method.name!r}, model {model_name!r}, "
                f"{windows.shape[0]} windows of {windows.shape[1]} tokens, chunk {chunk}"
                + (f"; it differs in {', '.join(differ)}" if differ else "")
                + "); delete it to start over"
            )
        _check_checkpoint(state, ckpt, windows.shape[0])
        per_window = [float(x) for x in state["window_nll"]]
        bits.add(state["bits"], state["values"])
        spent = float(state["seconds"])
    if ckpt is not None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
    done = len(per_window)
    t0 = time.perf_counter()
    it = range(done, windows.shape[0])
    bar = None
    if progress:
        from tqdm import tqdm

        if done:
            tqdm.write(f"resuming {method.name} from {ckpt} after {done} of {windows.shape[0]} windows")
        bar = tqdm(it, desc=f"ppl {method.name}", unit="window", initial=done, total=windows.shape[0])
        it = bar
    per_tok = windows.shape[1] - 1
    for i in it:
        cache = method.make_cache()
        nll, _ = window_nll(model, windows[i], cache, chunk)
        per_window.append(nll)
        bits.merge(stored_bits(cache))
        if ckpt is not None:
            state = {"kind": "ppl_checkpoint", **ident, "window_nll": per_window, "bits": bits.bits}
            state |= {"values": bits.values, "seconds": spent + time.perf_counter() - t0}
            atomic_write(ckpt, json.dumps(state))  # an interrupted write never leaves a torn checkpoint
        if bar is not None:
            bar.set_postfix(ppl=f"{math.exp(sum(per_window) / (len(per_window) * per_tok)):.4f}")
    total_nll, total_tok = sum(per_window), len(per_window) * per_tok
    result = PplResult(
        method=method.name,
        ppl=math.exp(total_nll / total_tok),
        effective_bits=bits.effective_bits,
        tokens=total_tok,
        windows=int(windows.shape[0]),
        model=model_name,
        window=int(windows.shape[1]),
        chunk=chunk,
        nll=total_nll,
        seconds=spent + time.perf_counter() - t0,
        window_nll=per_window,
        extra={
            "family": method.family,
            "params": method.params,
            "key_position": method.key_position,
            "note": method.note,
            **method.extra,
            "model_weights": weights,
            "numerics": numerics,
        },
    )
    if ckpt is not None:
        ckpt.unlink(missing_ok=True)
    return result


def _warn_if_calibrated_on(method: str, thresholds: Any, calibration: Any, dataset: str, text_file: Any) -> None:
    """Warn when a method that calibrates here is scored on its own calibration text (the same named text, or the
    same file): its perplexity is then not held-out. (Calibrating on wikitext2 warns where the windows are cut.)"""
    from oakenkv.calibrate.spec import CalibrationSpec
    from oakenkv.methods.registry import FAMILIES, parse_spec

    family = FAMILIES[parse_spec(method)[0]]
    if thresholds is not None or not family.calibrates:
        return
    spec = calibration if isinstance(calibration, CalibrationSpec) else CalibrationSpec()
    if spec.text == "wikitext2":
        return
    if text_file is not None:
        same = spec.text == "file" and Path(spec.text_path).resolve() == Path(text_file).expanduser().resolve()
        name = str(text_file)
    else:
        same, name = spec.text == dataset, dataset
    if same:
        warnings.warn(
            f"{method} is calibrated on the text it is scored on ({name}): its perplexity is not held-out; score "
            "another text (--dataset wikitext2; Wikipedia's held-out pages: --dataset wikipedia-heldout)",
            UserWarning,
            stacklevel=3,
        )


def run_ppl(
    model: str = "default",
    method: str = "oaken",
    *,
    thresholds: str | None = None,
    window: int = 2048,
    stride: int | None = None,
    max_windows: int | None = None,
    chunk: int | None = None,
    dataset: str = "wikitext2",
    calibration: Any = None,
    progress: bool = True,
    checkpoint: str | Path | None = None,
    text_file: str | Path | None = None,
) -> PplResult:
    """Load ``model`` and the evaluation text, build ``method`` and measure perplexity (the CLI's body).

    ``checkpoint``: see :func:`perplexity` (resume an interrupted run). ``text_file``: evaluate on this file (a
    user's own text: a regular UTF-8 file of at most 64 MiB) instead of ``dataset``; the result records its path,
    size and SHA-256.

    Every argument is validated before the model loads (:func:`check_run_args`)."""
    from oakenkv.assets.data import adds_bos, load_text, load_text_file, token_windows
    from oakenkv.assets.models import load_model
    from oakenkv.methods.registry import build_method, parse_spec

    check_run_args(
        model, method, thresholds, dataset=dataset, window=window, stride=stride, chunk=chunk, text_file=text_file
    )
    if max_windows is not None and (isinstance(max_windows, bool) or not isinstance(max_windows, int)):
        raise ValueError(f"max_windows must be None or an int >= 1, got {max_windows!r}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be None or an int >= 1, got {max_windows!r}")
    _warn_if_calibrated_on(method, thresholds, calibration, dataset, text_file)
    loaded = load_model(model)
    check_positions(loaded.model, window, f"windows of {window} tokens", "--window {most} or less")
    source = None
    if text_file is not None:
        text = load_text_file(text_file)
        raw = text.encode("utf-8")
        source = {
            "path": str(Path(text_file).expanduser().resolve()),
            "bytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),
        }
    else:
        text = load_text(dataset)
    ids = token_windows(loaded.tokenizer, text, window, stride, max_windows)
    m = build_method(
        method, loaded.model, loaded.tokenizer, model, thresholds=thresholds, calibration=calibration, progress=progress
    )
    res = perplexity(loaded.model, ids, m, chunk=chunk, progress=progress, model_name=model, checkpoint=checkpoint)
    family, params = parse_spec(method)
    if family != "fp" and res.effective_bits >= 16:
        held = f" ({family}'s is {params['residual']} tokens)" if params.get("residual") else ""
        warnings.warn(
            f"{method}: no key or value was quantized in these windows ({res.effective_bits:.2f} bits per value): a "
            f"method that keeps its newest tokens at full precision quantizes nothing when the window ({window} "
            f"tokens) is no longer than that residual window{held}; use longer windows (--window) or a shorter "
            "residual (e.g. kivi:bits=4,residual=32)",
            NothingQuantizedWarning,
            stacklevel=2,
        )
    if family == "quanto" and chunk is None:
        warnings.warn(
            f"{method}: transformers' QuantizedCache returns the unquantized states of its first update, so in one "
            "forward per window the attention reads no quantized key or value: this is FP's perplexity while "
            f"{res.effective_bits:.2f} bits per value are stored; feed each window in chunks (--chunk 128)",
            NothingQuantizedWarning,
            stacklevel=2,
        )
    res.stride = stride or window
    res.dataset = dataset if source is None else "file"
    if source is not None:
        res.extra["text_file"] = source
    res.bos = adds_bos(loaded.tokenizer)
    return res
