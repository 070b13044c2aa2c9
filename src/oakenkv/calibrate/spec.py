"""Which calibration text, and how much of it, a profile is made from: :class:`CalibrationSpec`.

Validated on construction and importable without torch, so that the command line checks ``--calib-*`` options
before anything loads; ``oakenkv.calibrate.profile`` (which cuts the windows and profiles) re-exports it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["DEFAULT_CALIB_SAMPLES", "DEFAULT_CALIB_TEXT", "DEFAULT_CALIB_WINDOW", "CalibrationSpec"]

#: Default calibration of a cached profile: the Wikipedia excerpt, 16 windows of 256 tokens. The paper averages
#: ~100 runs; 16 keep calibration to minutes on 2 shared CPU cores (``oakenkv profile`` defaults to 100 runs).
DEFAULT_CALIB_TEXT = "wikipedia"
DEFAULT_CALIB_SAMPLES = 16
DEFAULT_CALIB_WINDOW = 256


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

    def tag(self) -> str:
        path = "" if self.text_path is None else "-" + hashlib.sha1(self.text_path.encode()).hexdigest()[:8]
        return f"{self.text}{path}-{self.samples}x{self.window}"
