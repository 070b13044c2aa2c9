"""The one sanitizer for text oakenkv did not write itself, before it reaches a terminal.

A shared profile's metadata, a result file's method name, a model's name or path, a model's generated text, an
error message quoting a file: any of them may hold terminal escape sequences (``\\x1b]8;;...`` hyperlinks, cursor
moves, a title change), C1 controls (``\\x9b`` is a CSI on many terminals), Unicode direction overrides (text that
reads differently from what it is), or rich markup (``[link=...]``, or ``[/]``, which makes rich raise). Printed
raw, they act on the user's terminal or crash the command.

:func:`printable` makes every such character visible as its escape (``\\x1b``, ``\\u202e``) and keeps the rest;
:func:`markup_safe` does that and escapes rich markup, for text that goes through a ``rich`` console's markup.
Standard library only (rich's escape is imported when first needed).
"""

from __future__ import annotations

import re
from typing import Any

#: C0 controls but tab and newline, DEL, C1 controls, and Unicode's invisible direction and line controls.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
#: The same, newline and tab included (text printed on one line).
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _visible(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: Any, *, newlines: bool = False, limit: int | None = None) -> str:
    """``str(text)`` with every control, escape and direction character written as its visible escape; tab and
    newline kept when ``newlines`` (else escaped too). ``limit``: at most that many characters of the result, the
    cut said with ``...``."""
    s = (_UNSAFE if newlines else _UNSAFE_LINE).sub(_visible, str(text))
    if limit is not None and len(s) > limit:
        s = s[: max(0, limit - 3)] + "..."
    return s


def markup_safe(text: Any, *, newlines: bool = False, limit: int | None = None) -> str:
    """:func:`printable`, then rich markup escaped: for text placed inside a markup string a ``rich`` console
    renders, before more markup (``f"[bold]{markup_safe(name)}[/]"``). At the very end of what is rendered, rich
    shows an escaped final backslash twice: print such text as a ``rich.text.Text`` of :func:`printable` instead."""
    from rich.markup import escape

    return escape(printable(text, newlines=newlines, limit=limit))


__all__ = ["markup_safe", "printable"]
