"""Resource limits checked up front: the memory a job will need, against what the machine has, before the work.

Standard library only (the CLI checks its arguments with it before importing torch).
"""

from __future__ import annotations

import os

__all__ = ["ResourceLimitError", "available_memory", "check_memory", "format_bytes"]

#: Share of the available memory one job may plan to use (the rest: the model, Python, other processes).
MEMORY_SHARE = 0.8


class ResourceLimitError(ValueError):
    """An argument asks for more memory (or another resource) than the machine has; the message says how much."""


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (``MemAvailable`` on Linux; free physical pages elsewhere);
    None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


def check_memory(need: int, what: str, fix: str, available: int | None = None) -> None:
    """Raise :class:`ResourceLimitError` when ``need`` bytes are more than ``MEMORY_SHARE`` of the available
    memory: ``"<what> needs about <need>, more than the <avail> this machine has available; <fix>"``."""
    avail = available_memory() if available is None else available
    if avail is not None and need > MEMORY_SHARE * avail:
        raise ResourceLimitError(
            f"{what} needs about {format_bytes(need)} of memory, more than the {format_bytes(avail)} this machine "
            f"has available; {fix}"
        )
