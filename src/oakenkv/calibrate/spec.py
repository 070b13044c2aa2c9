"""Which calibration text, and how much of it, a profile is made from: :class:`CalibrationSpec`, and the token
windows it gives (:func:`calibration_windows`).

Validated on construction and importable without torch (the windows import it when cut), so that the command line
checks ``--calib-*`` options before anything loads; ``oakenkv.calibrate.profile`` re-exports both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CALIB_SAMPLES",
    "DEFAULT_CALIB_TEXT",
    "DEFAULT_CALIB_WINDOW",
    "CalibrationSpec",
    "calibration_text",
    "calibration_windows",
    "warn_if_short",
]

#: Default calibration of a cached profile: the Wikipedia excerpt, 16 windows of 256 tokens. The paper averages
#: ~100 runs; 16 keep calibration to minutes on 2 shared CPU cores (``oakenkv profile`` defaults to 100 runs).
DEFAULT_CALIB_TEXT = "wikipedia"
DEFAULT_CALIB_SAMPLES = 16
DEFAULT_CALIB_WINDOW = 256


def max_positions(model: Any) -> int | None:
    """The positions a model (or its config) can attend over (``max_position_embeddings`` of its text decoder), or
    None where the config does not say."""
    cfg = model.config if hasattr(model, "config") else model
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    most = getattr(cfg, "max_position_embeddings", None)
    return most if isinstance(most, int) else None


def check_positions(model: Any, tokens: int, what: str, fix: str | None = None, *, table_only: bool = False) -> None:
    """ValueError when ``what`` (``tokens`` positions) goes past the positions ``model`` can attend over: a learned
    position table (GPT-2, OPT) fails inside torch's embedding there, and rotary models were not trained there.
    ``fix``: the way out, ``{most}`` standing for the model's positions. ``table_only``: refuse only a model with a
    learned position table (a timing benchmark may run a rotary model past its trained length)."""
    most = max_positions(model)
    if most is None or tokens <= most or (table_only and not has_position_table(model)):
        return
    way = f" ({fix.format(most=most)})" if fix else ""
    raise ValueError(f"{what}: {tokens} positions, but the model has {most}{way}")


def has_position_table(model: Any) -> bool:
    """Whether ``model`` looks positions up in a learned table (GPT-2's ``wpe``, OPT's ``embed_positions``, BERT-style
    ``position_embeddings``), which has no row past its length."""
    import torch

    names = ("wpe", "embed_positions", "position_embeddings")
    return any(isinstance(m, torch.nn.Embedding) and n.rsplit(".", 1)[-1] in names for n, m in model.named_modules())


@dataclass(frozen=True)
class CalibrationSpec:
    """Which text and how much of it calibration uses.

    ``text`` is an ``oakenkv.assets.data.load_text`` name ("wikipedia", the default; "wikitext2" is the evaluation
    text and warns) or "file" for the plain text file at ``text_path``.
    """

    text: str = DEFAULT_CALIB_TEXT
    samples: int = DEFAULT_CALIB_SAMPLES
    window: int = DEFAULT_CALIB_WINDOW
    text_path: str | None = None

    def __post_init__(self) -> None:
        from oakenkv.assets.data import TEXTS

        for name, least in (("samples", 1), ("window", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"calibration {name} must be an int >= {least}, got {v!r}")
        if self.text not in (*TEXTS, "file"):
            raise ValueError(f"unknown calibration text {self.text!r}; known: {', '.join([*TEXTS, 'file'])}")
        if self.text == "file" and self.text_path is None:
            raise ValueError("calibration text 'file' needs a path (--calib-path)")

    def fit(self, model: Any) -> CalibrationSpec:
        """This spec with its windows no longer than ``model``'s positions (:func:`max_positions`: GPT-2's 1024
        under oaken-plus's 2048-token windows), with a warning when it shortens them."""
        most = max_positions(model)
        if most is None or most < 2 or self.window <= most:
            return self
        warnings.warn(
            f"calibration windows of {self.window} tokens are longer than the model's {most} positions: using {most}",
            stacklevel=3,
        )
        return dataclasses.replace(self, window=most)

    def tag(self) -> str:
        """A short name of this calibration for labels and cache file names: ``<text>[-<digest>]-<samples>x<window>``.
        The digest is of a "file" text's content (the same text under another path is the same calibration, an edited
        file another one); of the path for a packaged text's own file (a Wikipedia dump may be gigabytes), or for a
        file the reader would refuse (not a regular file, too large, unreadable: the reader then says why)."""
        if self.text_path is None:
            return f"{self.text}-{self.samples}x{self.window}"
        digest = hashlib.sha1(self.text_path.encode()).hexdigest()[:8]
        if self.text == "file":
            from oakenkv.util.paths import MAX_TEXT_BYTES, file_sha256  # (memoised by path, size and mtime)

            try:  # only a regular file the reader would take: a pipe would block the hash, /dev/zero never end it
                st = os.stat(self.text_path)
                if stat.S_ISREG(st.st_mode) and st.st_size <= MAX_TEXT_BYTES:
                    digest = file_sha256(self.text_path)[:8]
            except OSError:
                pass
        return f"{self.text}-{digest}-{self.samples}x{self.window}"


def calibration_text(text: str, path: str | None) -> str:
    """The calibration text ``text`` names: an ``oakenkv.assets.data.load_text`` name (``path``: its file, if not
    the packaged one) or "file", the plain UTF-8 text file at ``path`` (a regular file, size-capped)."""
    if text == "file":
        if path is None:
            raise ValueError("calibration text 'file' needs a path (--calib-path)")
        from oakenkv.util.paths import MAX_TEXT_BYTES, read_text_capped

        return read_text_capped(path, "the calibration text file", MAX_TEXT_BYTES)
    from oakenkv.assets.data import load_text

    return load_text(text, path)


def warn_if_short(
    ids: torch.Tensor, samples: int, window: int, text: str, path: str | None, stacklevel: int = 3
) -> None:
    """Warn when the calibration text ``text`` (``path``: a "file" text's file) gave fewer than ``samples`` windows
    of ``window`` tokens (``ids``: what it gave): a short text would otherwise calibrate on less than asked, under a
    label that says otherwise."""
    if ids.shape[0] < samples:
        what = f"the calibration text {path!r}" if text == "file" else f"the {text!r} text"
        warnings.warn(
            f"{what} holds only {ids.shape[0]} window{'' if ids.shape[0] == 1 else 's'} of {window} tokens, fewer "
            f"than the {samples} asked for: "
            "calibrating on those (a longer text, or fewer or shorter windows, calibrates as asked)",
            UserWarning,
            stacklevel=stacklevel,
        )


def check_windows(model: Any, windows: Any) -> None:
    """Refuse calibration windows a profile cannot use: not an int64 tensor ``[runs, tokens]`` with at least one
    token, or token ids the model has no embedding for (a tokenizer of another model: torch's embedding would
    fail deep inside the first forward pass, or a larger table read the wrong rows)."""
    import torch

    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.int64:
        raise ValueError(f"windows must be an int64 tensor [runs, tokens], got {getattr(windows, 'shape', windows)}")
    if windows.shape[0] < 1 or windows.shape[1] < 1:
        raise ValueError(f"need at least one window of at least one token, got {tuple(windows.shape)}")
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    size = getattr(embeddings, "num_embeddings", None)
    low, high = int(windows.min()), int(windows.max())
    if low < 0 or (size is not None and high >= size):
        embeds = "no negative ids" if size is None else f"ids 0..{size - 1}"
        raise ValueError(
            f"the calibration windows hold token ids {low}..{high} but the model embeds {embeds}: the tokenizer is "
            "not this model's (pass the model's own tokenizer)"
        )


def calibration_windows(tokenizer: Any, spec: CalibrationSpec) -> torch.Tensor:
    """int64 ``[samples, window]`` token windows of the calibration text (warns if it is WikiText-2, or too short
    for ``samples`` windows)."""
    from oakenkv.assets.data import token_windows

    if spec.text == "wikitext2":
        warnings.warn("calibrating on wikitext2, the evaluation text: results are not held-out", stacklevel=2)
    text = calibration_text(spec.text, spec.text_path)
    ids = token_windows(tokenizer, text, spec.window, max_windows=spec.samples)
    warn_if_short(ids, spec.samples, spec.window, spec.text, spec.text_path)
    return ids
