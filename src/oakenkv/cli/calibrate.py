"""Commands of the offline half: ``profile`` (thresholds, oaken-plus transforms) and ``inspect``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from oakenkv.cli._common import (
    MAX_TOKENS,
    MAX_WINDOWS,
    ModelOption,
    app,
    bad_option,
    check_input,
    check_model,
    check_out,
    one_line,
    save_output,
)
from oakenkv.util.numerics import pin_cpu_numerics
from oakenkv.util.paths import MAX_TEXT_BYTES

if TYPE_CHECKING:
    from oakenkv.calibrate.thresholds import Thresholds


@app.command("profile")
def profile_cmd(
    model: ModelOption = "default",
    preset: Annotated[
        str,
        typer.Option(
            help="'oaken': the paper's thresholds at fixed group ratios. 'oaken-plus': offline transforms (key "
            "shift, key smoothing folded into the weights, per-head rotations) and group ratios chosen per layer by "
            "the attention-output error on the calibration text, then thresholds profiled after them (docs/plus.md). "
            "'oaken-plus-3' / '-2' / '-5' / '-6' / '-7': the same at a 3- / 2- / 5- / 6- / 7-bit dense slot and a 4% "
            "sparse share (-3: rotations allowed)."
        ),
    ] = "oaken",
    samples: Annotated[
        int | None,
        typer.Option(
            help="Calibration windows (= profiling runs) averaged; the paper uses about 100, fewer warn. "
            "Default: 100 for oaken, 16 for oaken-plus.",
            min=1,
            max=MAX_WINDOWS,
        ),
    ] = None,
    window: Annotated[
        int | None,
        typer.Option(
            help="Tokens per calibration window. Default: 256 for oaken (enough positions for per-layer thresholds, "
            "and short runs); 2048 for oaken-plus, whose key shift is a mean over the positions it sees (longer "
            "runs: the profile takes many times as long).",
            min=2,
            max=MAX_TOKENS,
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Where to write the thresholds JSON file.")] = Path("thresholds.json"),
    data: Annotated[
        str,
        typer.Option(
            help="Calibration text: 'wikipedia' (the default calibration excerpt), 'wikitext2' (the "
            "evaluation text; warned about, since perplexity on it is then not held-out) or 'file' (your own plain "
            "UTF-8 text at --data-path: calibrate on the domain you serve)."
        ),
    ] = "wikipedia",
    data_path: Annotated[
        Path | None,
        typer.Option(
            help="Read the calibration text from this file: a MediaWiki XML dump (.xml, .xml.bz2) for 'wikipedia', "
            "the WikiText-2 file for 'wikitext2', any plain UTF-8 text for 'file'.",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ] = None,
    outer_ratio: Annotated[float, typer.Option(help="Fraction of values in the outer group.")] = 0.04,
    inner_ratio: Annotated[float, typer.Option(help="Fraction of values in the inner group.")] = 0.06,
    pre_rope: Annotated[
        bool,
        typer.Option(
            "--pre-rope/--post-rope",
            help="Profile keys before RoPE (as the official harness) instead of after it (what the cache stores).",
        ),
    ] = False,
    kurtosis_tuning: Annotated[
        bool,
        typer.Option(
            help="Per layer, raise the outer ratio by 0.5 points where kurtosis > 20 and lower the inner ratio by "
            "0.3 points where kurtosis < 5; the adjustments are recorded in the file."
        ),
    ] = False,
    inner_center: Annotated[
        str,
        typer.Option(
            help="'median': the inner group is the values around the median (default); 'zero': the values of "
            "smallest magnitude."
        ),
    ] = "median",
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass (speed only).", min=1)] = 1,
    threads: Annotated[
        int | None,
        typer.Option(
            help="torch CPU threads (default: torch's choice). On a machine shared with other jobs, 1 is much "
            "faster than threads that wait for each other's time slices (docs/notebook/perf-notes.md).",
            min=1,
        ),
    ] = None,
) -> None:
    """Profile the per-layer Oaken thresholds of a model on calibration text and save them as JSON."""
    pin_cpu_numerics()  # the same numbers on every x86-64 CPU (oakenkv.util.numerics)
    from oakenkv.assets.data import TEXTS
    from oakenkv.calibrate.presets import PRESETS
    from oakenkv.format.config import OakenConfig

    if preset not in PRESETS:
        raise bad_option("--preset", f"must be one of {', '.join(PRESETS)}, got {preset!r}")
    plus = PRESETS[preset].transforms
    config = OakenConfig(
        outer_ratio=outer_ratio, inner_ratio=inner_ratio, key_position="pre_rope" if pre_rope else "post_rope"
    )
    if plus and (pre_rope or kurtosis_tuning or (outer_ratio, inner_ratio) != (0.04, 0.06)):
        raise bad_option(
            "--preset", "oaken-plus chooses its own group ratios on post-RoPE keys; drop the ratio options"
        )
    if plus and (inner_center != "median" or batch_size != 1):
        option = "--inner-center" if inner_center != "median" else "--batch-size"
        raise bad_option(
            option, "applies to the paper's thresholds (--preset oaken); the oaken-plus search sets its own"
        )
    if data not in TEXTS and data != "file":
        raise bad_option("--data", f"unknown text {data!r}; known: {', '.join([*TEXTS, 'file'])}")
    if data == "file" and data_path is None:
        raise bad_option("--data", "'file' calibrates on your own text: give it with --data-path")
    if inner_center not in ("median", "zero"):
        raise bad_option("--inner-center", f"must be 'median' or 'zero', got {inner_center!r}")
    # a Wikipedia dump is streamed (any size; its first bytes checked); a plain text is read whole (capped)
    check_input(data_path, "--data-path", None if data == "wikipedia" else MAX_TEXT_BYTES, text=data != "wikipedia")
    if data_path is not None and data == "wikipedia":
        with open(data_path, "rb") as f:
            head = f.read(64)
        xml = head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"<"
        if not (head.startswith(b"BZh") if data_path.suffix == ".bz2" else xml):
            raise bad_option(
                "--data-path",
                f"{data_path} is not a MediaWiki XML dump (.xml or .xml.bz2); for a plain text file add --data file",
            )
    check_model(model)
    check_out(out, "--out")
    from oakenkv.calibrate.profile import DEFAULT_SAMPLES, DEFAULT_WINDOW, profile_model  # (imports torch)

    # oaken-plus: its preset's calibration; the paper's thresholds: the paper's ~100 runs
    samples = samples or (PRESETS[preset].calibration.samples if plus else DEFAULT_SAMPLES)
    window = window or (PRESETS[preset].calibration.window if plus else DEFAULT_WINDOW)

    if threads is not None:
        import torch

        torch.set_num_threads(threads)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = {"data": data, "data_path": None if data_path is None else str(data_path)}
        if plus:
            from oakenkv.calibrate.plus import profile_plus_model

            search = PRESETS[preset].search()  # its slot width and sparse share
            th = profile_plus_model(model, samples=samples, window=window, search=search, progress=True, **source)
        else:
            th = profile_model(
                model,
                samples=samples,
                window=window,
                config=config,
                kurtosis_tuning=kurtosis_tuning,
                inner_center=inner_center,  # type: ignore[arg-type]
                batch_size=batch_size,
                progress=True,
                **source,
            )
    for w in caught:
        if issubclass(w.category, UserWarning):
            typer.secho(f"warning: {one_line(str(w.message))}", fg="yellow", err=True)
    path = save_output(out, th.save, "--out")  # (never lost: minutes of profiling)
    typer.echo(
        f"profiled {th.fingerprint.describe()} on {th.profile['runs']} x {th.profile['window']} tokens of "
        f"{data_path if data == 'file' else data} in {th.profile['seconds']:.1f} s; wrote {path} (see `oakenkv "
        f"inspect {path}`)"
    )


@app.command("inspect")
def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="A thresholds JSON file written by `oakenkv profile`.")],
    layers: Annotated[bool, typer.Option(help="Print the per-layer table (--no-layers: header only).")] = True,
) -> None:
    """Print a thresholds file: model, config, how it was profiled and the per-layer thresholds and kurtosis."""
    from oakenkv.calibrate.thresholds import Thresholds

    print_thresholds(Thresholds.load(path), layers=layers)


def print_thresholds(th: Thresholds, console: Any = None, layers: bool = True) -> None:
    """Print a profile for people: model, config, how it was profiled, and (``layers``) a per-layer table.

    Everything that came from the file is printed through :func:`oakenkv.util.text.printable` (escape sequences and
    control characters made visible) and cut to a line's worth, and no markup is interpreted: a shared profile
    cannot act on the terminal. The table is plain text, written at once (a 4096-layer profile prints in well
    under a second; a rich table of it took minutes).

    ``console`` is a ``rich.console.Console`` to write to (default: standard output).
    """
    from oakenkv.util.text import printable

    def text(v: Any, limit: int = 200) -> str:
        return printable(v, limit=limit)

    c = th.config
    kinds = ("key", "value")
    ratios = [(st.outer_ratio, st.inner_ratio) for i in range(th.num_layers) for k in kinds if (st := th.stats(i, k))]
    own = sum(abs(o - c.outer_ratio) > 1e-9 or abs(n - c.inner_ratio) > 1e-9 for o, n in ratios)
    per_layer = ""
    if own:  # (oaken-plus chooses each layer's and kind's group ratios; kurtosis tuning raises some)
        outer, inner = zip(*ratios, strict=True)
        per_layer = (
            f" (the config's; {own} of {len(ratios)} layer rows have their own: outer {min(outer):.2%}-"
            f"{max(outer):.2%}, inner {min(inner):.2%}-{max(inner):.2%}, in the tables)"
        )
    lines = [
        f"model   {text(th.fingerprint.describe())}",
        f"config  outer {c.outer_ratio:.2%} / middle {c.middle_ratio:.2%} / inner {c.inner_ratio:.2%}{per_layer}; "
        f"bits middle {c.to_dict()['middle_bits']}, inner {c.inner_bits}, outer {c.outer_bits}; keys {c.key_position}, "
        f"granularity {c.granularity}, scales {c.scale_dtype}",
    ]
    if th.profile:
        shown = [f"{text(k, 40)}={text(v, 80)}" for k, v in list(th.profile.items())[:32] if v is not None]
        more = len(th.profile) - 32
        lines.append("profile " + text(", ".join(shown), 2000) + (f" (and {more} more fields)" if more > 0 else ""))
    if th.transforms is not None:
        t = th.transforms
        lines.append(
            f"transforms oaken-plus: {sum(lt.key_shift is not None for lt in t.layers)} key shifts, "
            f"{sum(lt.key_scale is not None for lt in t.layers)} key scales, {sum(lt.key_rotation for lt in t.layers)} "
            f"key and {sum(lt.value_rotation for lt in t.layers)} value rotations, {t.sink_tokens} sink tokens"
        )
    if layers:
        head = ("layer", "to_lo", "ti_lo", "ti_hi", "to_hi", "outer", "inner", "kurtosis", "runs")
        for kind in kinds:
            lines += ["", f"{kind} thresholds per decoder layer (outer, inner: the group ratios they were set for)"]
            lines.append("  ".join(f"{h:>9}" for h in head) + "  notes")
            for i in range(th.num_layers):
                st = th.stats(i, kind)
                cells = [str(i), *(f"{v:+.4f}" for v in th.layer(i, kind).as_tuple())]
                cells += (
                    ["-"] * 4
                    if st is None
                    else [f"{st.outer_ratio:.2%}", f"{st.inner_ratio:.2%}", f"{st.kurtosis:.1f}", str(st.num_runs)]
                )
                notes = "" if st is None else text("; ".join(st.adjustments), 100)
                lines.append("  ".join(f"{x:>9}" for x in cells) + ("  " + notes if notes else ""))
    import sys

    f = sys.stdout if console is None else console.file
    f.write("\n".join(lines) + "\n")
    f.flush()
