"""``oakenkv export``: a Hugging Face model directory vLLM serves with Oaken's KV cache, its profile inside.

vLLM loads weights from a directory, so the offline transforms of a profile that fold into the weights (an
``oaken-plus`` profile's key smoothing and value rotations) must be in the directory it serves. :func:`export_model`
gets the model's profile for a preset as ``OakenCache.for_model`` does (``oakenkv.calibrate.presets.find_profile``:
a profile named, one shipped for an embedded model, one cached by content, or a new one profiled on the calibration
text), folds it into the weights (``oakenkv.calibrate.plus.apply_profile``, which marks the config with the
transforms' digest), and writes:

- the weights as safetensors, the config (with the fold mark ``oakenkv_transforms``), the generation config and the
  tokenizer (``save_pretrained``);
- the profile as ``oakenkv-profile.json``, its metadata recording the export: the digest of the weights written
  (``served.weights_digest``, by content), the transforms' digest and the model it came from.

The plugin finds the profile there when ``OAKENKV_VLLM_PROFILE`` is not set, and refuses it at start when the
served weights are not the ones it records (``oakenkv.integrations.vllm.check_served``). The directory loads in
transformers as it is (``AutoModelForCausalLM.from_pretrained``): ``OakenCache.from_profile`` on it with its profile
runs the same folded model.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from oakenkv.integrations.vllm import LEVELS_REFUSED, _oaken, slot_refusal
from oakenkv.integrations.vllm.served import EXPORT_KEY, PROFILE_FILE, weights_digest


def check_export_dir(out: Path) -> None:
    """Refuse an output directory that exists and is not empty (a previous export is replaced only when it is one:
    it holds ``oakenkv-profile.json``), or one that cannot be created."""
    out = Path(out)
    if out.is_symlink():  # (a previous export is replaced by removing it, which a link cannot be)
        raise ValueError(f"--out {out} is a symbolic link; give the directory it points to, or a new one")
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"--out {out} is a file; give a directory")
        if any(out.iterdir()) and not (out / PROFILE_FILE).is_file():
            raise ValueError(f"--out {out} is a non-empty directory that holds no export; give a new directory")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot create it in {parent}")


def export_model(
    model: Any,
    tokenizer: Any,
    out: str | os.PathLike[str],
    preset: str = "oaken-plus",
    *,
    profile: Any = None,
    source: str | None = None,
    progress: bool = True,
    static_grids: bool = False,
    dtype: Any = None,
) -> Path:
    """Write ``model`` (a transformers causal LM, in place folded with its profile) and ``tokenizer`` to ``out`` as a
    servable directory with ``oakenkv-profile.json`` (module docstring); returns the profile's path.

    Args:
        preset: ``"oaken-plus"`` (default) or ``"oaken"`` (the presets of other slot widths are refused: the plugin
            serves 4-bit slots, ``oakenkv.integrations.vllm.SERVED_SLOT_BITS``).
        profile: a profile (path or ``Thresholds``) of ``preset``'s kind for this model, else found or made as by
            ``OakenCache.for_model``.
        source: where the model came from (recorded).
        static_grids: write the profile with static middle/inner grids (``OakenConfig.static_grids``: the blocks
            store each token's outer scales alone, 0.33 bit per value less at 192 values per row; docs/format.md).
        dtype: the ``torch.dtype`` to write the weights in (e.g. the checkpoint's bfloat16 when the model was loaded
            in float32 to fold); the model is cast after the fold, its fold record kept true
            (``oakenkv.calibrate.match.cast_folded``). Default: the model's own.
    """
    if preset not in _oaken.PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(_oaken.PRESETS)}")
    refused = slot_refusal(_oaken.PRESETS[preset].middle_bits)
    if refused is not None:  # (before any work: the plugin would refuse the directory at start)
        raise ValueError(f"preset {preset!r}: {refused}")
    out = Path(out)
    check_export_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the directory the export is written in, made before any work: a target that cannot take it fails now
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        thr = _oaken.find_profile(model, preset, tokenizer=tokenizer, profile=profile, progress=progress)
        if thr.config.static_levels:  # (before the model is folded and written: the plugin would refuse it)
            raise NotImplementedError(LEVELS_REFUSED)
        if static_grids:
            thr = dataclasses.replace(thr, config=thr.config.replace(static_grids=True))
        _oaken.apply_profile(model, thr)
        # (also in the model's own dtype: the fold record then holds the folded weights' rounded digest, so that the
        # export read back in another dtype, as `vllm serve --dtype bfloat16` does, still fits its profile)
        _oaken.cast_folded(model, dtype if dtype is not None else model.dtype)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # (mkdtemp makes it private; the export is a model directory like any)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        t = thr.transforms
        record = {
            "weights": weights_digest(tmp),
            "transforms": None if t is None else t.digest(),
            "preset": preset,
            "source": source,
            "source_weights": thr.fingerprint.weights,
            "dtype": str(getattr(model, "dtype", "")).removeprefix("torch."),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        exported = dataclasses.replace(thr, profile={**thr.profile, EXPORT_KEY: record})
        exported.save(tmp / PROFILE_FILE)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / PROFILE_FILE


__all__ = ["check_export_dir", "export_model"]
