"""``oakenkv info``: versions, threads, and where the embedded models and each data source were found.

:func:`collect_info` finds everything without loading a model (it only looks for files), so it is fast and safe
to run on a machine that is not set up yet: every missing piece is reported with the sentence saying how to
install it. :func:`print_info` renders it with rich.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["collect_info", "print_info"]

_PACKAGES = ("oakenkv", "torch", "transformers", "numpy", "numba", "safetensors", "gguf", "pyarrow", "gensim")


def _version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def _found(where: Any, note: str = "") -> dict[str, Any]:
    return {"found": True, "where": str(where), "note": note}


def _missing(err: Exception) -> dict[str, Any]:
    return {"found": False, "where": None, "note": str(err)}


def collect_info() -> dict[str, Any]:
    """A JSON-able description of the installation.

    Keys: ``python``, ``platform``, ``versions`` (package -> version or None), ``threads`` (cpu_count, torch
    intra-op threads, numba threads), ``cache`` (the oakenkv cache directory), ``models`` and ``data`` (name ->
    ``{"found": bool, "where": path or None, "note": detail or the error sentence}``).
    """
    from oakenkv.assets import data, models

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {p: _version(p) for p in _PACKAGES},
        "threads": {"cpu_count": os.cpu_count()},
        "cache": str(models.cache_root()),
        "models": {},
        "data": {},
    }
    try:
        import torch

        info["threads"]["torch"] = torch.get_num_threads()
    except ImportError:
        info["threads"]["torch"] = None
    try:
        import numba

        info["threads"]["numba"] = numba.config.NUMBA_NUM_THREADS
    except ImportError:
        info["threads"]["numba"] = None

    for name in models.EMBEDDED_MODELS:
        try:
            parts = models.embedded_parts(name)
        except models.MissingModelError as e:
            info["models"][name] = {**_missing(e), "optional": models.EMBEDDED_MODELS[name].optional}
            continue
        if len(parts) == 1:
            cached = models.locate_model(name).cached
            note = f"converted: {cached}" if cached else "not converted yet (the first load converts it, once)"
            info["models"][name] = _found(parts[0], note)
        else:
            # Assembling a split GGUF copies ~250 MB: info only reports the parts, load_model assembles.
            info["models"][name] = _found(parts[0].parent, f"{len(parts)} parts installed; assembled on first load")

    for name in data.TEXTS:
        try:
            info["data"][name] = _found(data.locate_text(name), data.TEXTS[name])
        except data.DataNotFoundError as e:
            info["data"][name] = _missing(e)
    for name in data.TASKS:
        try:
            info["data"][name] = _found(data.locate_task(name), "zero-shot task")
        except data.DataNotFoundError as e:
            info["data"][name] = _missing(e)
    return info


def print_info() -> dict[str, Any]:
    """Print :func:`collect_info` as tables and return it."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from oakenkv.util.text import printable

    info = collect_info()
    console = Console()
    console.print(f"[bold]oakenkv[/bold] {info['versions']['oakenkv']}  (Python {info['python']}, {info['platform']})")
    versions = ", ".join(f"{k} {v or '[red]missing[/red]'}" for k, v in info["versions"].items() if k != "oakenkv")
    console.print(f"versions: {versions}")
    t = info["threads"]
    console.print(f"threads: {t['cpu_count']} CPUs, torch {t['torch']}, numba {t['numba']}")
    console.print("cache: " + printable(info["cache"]), markup=False)
    for title, section in (("Models", info["models"]), ("Data", info["data"])):
        table = Table(title=title, title_justify="left")
        table.add_column("name")
        table.add_column("status")
        table.add_column("where / how to install", overflow="fold")
        for name, entry in section.items():
            if entry["found"]:
                status = "[green]found[/green]"
            else:
                status = "[yellow]not installed (optional)[/yellow]" if entry.get("optional") else "[red]MISSING[/red]"
            detail = (
                entry["where"] + (f"\n{entry['note']}" if entry["note"] else "") if entry["found"] else entry["note"]
            )
            table.add_row(name, status, Text(printable(detail, newlines=True)))
        console.print(table)
    return info
