"""``oakenkv diagnose``'s output: the table printed to the terminal and the channels x layers heat map."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from oakenkv.apps.diagnose import KINDS, Diagnosis, decibels, percent

# ----------------------------------------------------------------------------------------------- output


def print_diagnosis(diag: Diagnosis, console: Any = None) -> None:
    """Two tables (channels per layer; SQNR per layer and method) and the verdict, on a rich console."""
    from rich.console import Console
    from rich.table import Table

    from oakenkv.util.text import markup_safe, printable

    console = Console() if console is None else console
    d = len(diag.layers[0].keys.absmax_rel)
    cal = diag.calibration
    console.print(
        f"[bold]{markup_safe(diag.model)}[/]: {diag.fingerprint.get('num_layers')} layers, {d} K/V channels "
        f"({d // diag.head_dim} KV heads x {diag.head_dim}); {cal['windows']} x {cal['window']} tokens of "
        f"{markup_safe(cal.get('text', 'calibration text'))}; top k = {diag.top_k} channels "
        f"(uniform share {diag.top_k / d:.1%})"
    )
    t = Table(title="channels per layer (share of outer-group values in the top-k channels; absmax / median)")
    cols = ["layer", "K outer top-k", "K pre-RoPE", "K absmax x", "K top channel", "K |mean|/max", "K offset pow"]
    cols += ["K pre offset", "V outer top-k", "V absmax x", "flags"]
    for c in cols:
        t.add_column(c, justify="right" if c != "flags" else "left")
    for layer in diag.layers:
        k, p, v = layer.keys, layer.keys_pre_rope, layer.values
        flags = ("fixed-channel " if layer.fixed_channel_keys else "") + ("offsets" if layer.key_offsets else "")
        t.add_row(
            str(layer.index),
            percent(k.outer_share),
            "-" if p is None else percent(p.outer_share),
            f"{k.absmax_ratio:.1f}",
            diag.channel_name(k.absmax_channels[0]),
            f"{k.mean_ratio:.2f}",
            f"{k.offset_power:.1%}",
            "-" if p is None else f"{p.offset_power:.1%}",
            percent(v.outer_share),
            f"{v.absmax_ratio:.1f}",
            flags.strip(),
        )
    console.print(t)
    methods = list(diag.methods)
    t = Table(title="reconstruction SQNR (dB) per layer: keys | values")
    t.add_column("layer", justify="right")
    for m in methods:
        t.add_column(f"K {m}", justify="right")
    for m in methods:
        t.add_column(f"V {m}", justify="right")
    for layer in diag.layers:
        cells = [_cell(layer.sqnr[m]["key"]) for m in methods] + [_cell(layer.sqnr[m]["value"]) for m in methods]
        t.add_row(str(layer.index), *cells)
    t.add_section()
    t.add_row("all", *[_cell(diag.methods[m][kind]["sqnr_db"]) for kind in KINDS for m in methods])
    t.add_row("bits", *[f"{diag.methods[m][kind]['bits']:.2f}" for kind in KINDS for m in methods])
    console.print(t)
    for line in diag.notes:
        console.print(f"[dim]note: {markup_safe(line)}[/]")
    for line in diag.verdict["lines"]:
        console.print(printable(line), markup=False)


def _cell(x: float | None) -> str:
    if x is None or math.isinf(x):
        return "exact"
    return f"{x:.1f}"


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only), or an ImportError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; works on headless machines
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the diagnosis plot needs matplotlib, which is not installed: pip install 'oakenkv[eval]' (or pip "
            "install matplotlib); the diagnosis itself works without it (leave out --png)"
        ) from e
    return plt


def plot_diagnosis(diag: Diagnosis, path: str | Path) -> Path:
    """A PNG: heat maps (channels x layers) of each channel's absmax relative to its layer's median channel, for
    post-RoPE keys, pre-RoPE keys (when recorded) and values, on one log colour scale, heads separated by lines;
    the verdict's first lines as the title. Needs matplotlib (the ``eval`` extra)."""
    plt = require_matplotlib()
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FixedLocator, FuncFormatter

    panels = [("keys after RoPE (what the cache stores)", [layer.keys for layer in diag.layers])]
    if all(layer.keys_pre_rope is not None for layer in diag.layers):
        panels.append(("keys before RoPE", [layer.keys_pre_rope for layer in diag.layers]))  # type: ignore[misc]
    panels.append(("values", [layer.values for layer in diag.layers]))
    n = len(diag.layers)
    d = len(diag.layers[0].keys.absmax_rel)
    hd = diag.head_dim
    heads = d // hd
    mats = [np.array([s.absmax_rel for s in stats], dtype=np.float64) for _, stats in panels]
    vmin = 0.25
    vmax = max(4.0, max(float(np.max(m[np.isfinite(m)], initial=1.0)) for m in mats))
    norm = LogNorm(vmin=vmin, vmax=vmax)
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(min(16.0, 4.0 + d / 24), 1.4 + len(panels) * (0.9 + 0.11 * n)),
        squeeze=False,
        layout="constrained",
    )
    im = None
    tick_step = max(8, hd // 4)
    for ax, (title, _), mat in zip(axes[:, 0], panels, mats, strict=True):
        im = ax.imshow(np.clip(mat, vmin, vmax), aspect="auto", norm=norm, cmap="magma", interpolation="nearest")
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel("layer")
        step = max(1, math.ceil(n / 12))
        ax.set_yticks(list(range(0, n, step)))
        for b in range(hd, d, hd):
            ax.axvline(b - 0.5, color="cyan", lw=0.8)
        ax.set_xticks(
            [j * hd + c for j in range(heads) for c in range(0, hd, tick_step)],
            [str(c) for _ in range(heads) for c in range(0, hd, tick_step)],
            fontsize=7,
        )
        where = f"KV heads 0-{heads - 1} left to right, cyan lines between them" if heads > 1 else "one KV head"
        ax.set_xlabel(f"channel within its head ({where})", fontsize=8)
    assert im is not None
    cbar = fig.colorbar(im, ax=axes[:, 0].tolist(), shrink=0.8, pad=0.01)
    ticks = [t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128) if vmin <= t <= vmax]
    cbar.ax.yaxis.set_major_locator(FixedLocator(ticks))
    cbar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    cbar.ax.yaxis.set_minor_locator(FixedLocator([]))
    cbar.set_label("channel absmax / the layer's median channel absmax")
    v = diag.verdict
    k = diag.methods
    head = (
        f"{diag.model}: fixed-channel key outliers "
        + (f"YES in {len(v['fixed_channel_layers'])}/{n} layers" if v["fixed_channel_key_outliers"] else "no")
        + "; key offsets "
        + (f"YES in {len(v['key_offset_layers'])}/{n} layers" if v["key_offsets"] else "no")
        + "\nkey SQNR: "
        + ", ".join(f"{m} {decibels(k[m]['key']['sqnr_db'])}" for m in k)
    )
    fig.suptitle(head, fontsize=9)
    from oakenkv.util.paths import atomic_write

    path = atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)
    return path
