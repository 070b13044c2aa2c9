"""``oakenkv bench``: benchmarks of the codec, a decode step, the attention kernel and whole generations."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from oakenkv.cli._common import (
    MAX_TOKENS,
    ResidualOption,
    app,
    bad_option,
    check_decode_contexts,
    check_model,
    check_out,
    check_save,
    emit_result,
    load_thresholds,
    set_threads,
    start_run,
)

bench_app = typer.Typer(
    help="Benchmarks of oakenkv's components; each writes machine-readable JSON with --json.",
    no_args_is_help=True,
)


app.add_typer(bench_app, name="bench")


@bench_app.command("codec")
def bench_codec(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    save: Annotated[
        bool,
        typer.Option(help="Also save the result as benchmarks/results/<benchmark>/<point>.json (run metadata added)."),
    ] = False,
    threads: Annotated[int, typer.Option(help="CPU threads for the kernels, torch and quanto.", min=1)] = 2,
    reps: Annotated[int, typer.Option(help="Timed repetitions per measurement (the best is kept).", min=1)] = 5,
    quanto: Annotated[bool, typer.Option(help="Also time optimum-quanto's int4 quantize/dequantize.")] = True,
    real_kv: Annotated[
        bool, typer.Option(help="Also record real K/V of the default model for the storage comparison.")
    ] = True,
    real_tokens: Annotated[
        int, typer.Option(help="WikiText-2 tokens of real K/V to record (checked against the memory).", min=1)
    ] = 4096,
) -> None:
    """Encode/decode throughput of the fused dense-and-sparse format next to memcpy and quanto int4, effective
    bits, and pure dense vs pure sparse vs fused storage of the default model's real K/V."""
    if real_kv:
        _check_real_tokens(real_tokens)
    check_out(json_out, "--json")
    check_save(save, "codec", f"threads{threads}")
    start_run()
    from rich.console import Console

    from oakenkv.bench.codec import print_codec_bench, run_codec_bench

    console = Console(stderr=True)
    with console.status("benchmarking the codec") as status:
        result = run_codec_bench(
            threads=threads,
            reps=reps,
            quanto=quanto,
            real_kv=real_kv,
            real_tokens=real_tokens,
            progress=lambda msg: status.update(f"benchmarking the codec: {msg}"),
        )
    print_codec_bench(result)
    emit_result(result, json_out, save, "codec", f"threads{threads}")


#: Bytes the codec benchmark keeps per recorded token and per (layer, K/V value): float32 K and V of two texts
#: (WikiText-2 and the calibration text), twice over while they are concatenated and encoded.
_CODEC_BENCH_BYTES_PER_VALUE = 4 * 2 * 2 * 2


def _check_real_tokens(real_tokens: int) -> None:
    """``bench codec --real-tokens``: the memory its recording needs, before any work (1e9 tokens would grow
    until the machine runs out)."""
    from oakenkv.assets.models import model_kv_shape
    from oakenkv.util.resources import check_memory

    layers, dim = model_kv_shape("default") or (30, 192)  # the default model's shape until it is converted
    need = real_tokens * layers * dim * _CODEC_BENCH_BYTES_PER_VALUE
    check_memory(need, f"--real-tokens {real_tokens}", "record fewer tokens (4096 is the default)")


#: The caches `bench decode` and `bench generate` compare.
_BENCH_CACHES_HELP = (
    "Comma-separated caches to compare: oaken (OakenCache + packed attention), dynamic (fp32 DynamicCache), "
    "quanto (QuantizedCache, quanto int4)."
)


@bench_app.command("decode")
def bench_decode(
    context: Annotated[str, typer.Option(help="Comma-separated context lengths in tokens.")] = "1024,4096,16384",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    save: Annotated[
        bool,
        typer.Option(help="Also save the result as benchmarks/results/<benchmark>/<point>.json (run metadata added)."),
    ] = False,
    methods: Annotated[str, typer.Option(help=_BENCH_CACHES_HELP)] = "oaken,dynamic,quanto",
    steps: Annotated[int, typer.Option(help="Timed decode steps per point (the median is reported).", min=1)] = 5,
    batch: Annotated[int, typer.Option(help="Rows decoded together.", min=1)] = 1,
    residual: ResidualOption = 0,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for torch and numba (default: leave them as they are).", min=1)
    ] = None,
    thresholds: Annotated[
        Path | None, typer.Option(help="Thresholds file (default: a cached 16-window profile of the model).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model name (see `oakenkv info`).")] = "default",
) -> None:
    """Time one decode step and count KV-cache bytes at long contexts for OakenCache, transformers'
    DynamicCache (fp32) and QuantizedCache (quanto int4), all in one run."""
    from oakenkv.sim.report import parse_int_list

    contexts = parse_int_list(context, "--context")
    names = _check_methods(methods)
    if thresholds is not None and "oaken" not in names:
        raise bad_option("--thresholds", "the thresholds are for the 'oaken' method, which --methods does not include")
    if residual and "oaken" not in names:
        raise bad_option("--residual", "the window is the 'oaken' method's, which --methods does not include")
    check_model(model)
    thr_file = load_thresholds(thresholds, model)
    check_out(json_out, "--json")
    check_save(save, "decode", _point(contexts, batch=batch, residual=residual))
    check_decode_contexts(model, contexts, batch)  # (last: the one check that depends on the machine's load)
    start_run()
    from rich.console import Console

    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.models import load_model
    from oakenkv.bench.decode import print_decode_bench, run_decode_bench

    set_threads(threads)
    console = Console(stderr=True)
    with console.status("loading the model and thresholds") as status:
        thr = None
        if "oaken" in names:
            thr = load_or_profile_thresholds(load_model(model), thr_file)
        result = run_decode_bench(
            contexts,
            names,
            model=model,
            thresholds=thr,
            steps=steps,
            batch=batch,
            residual=residual,
            progress=lambda m: status.update(m),
        )
    print_decode_bench(result)
    emit_result(result, json_out, save, "decode", _point(contexts, batch=batch, residual=residual))


_BENCH_METHODS = ("oaken", "dynamic", "quanto")


def _check_attention_contexts(model: str, contexts: list[int], batch: int) -> None:
    """``bench attention`` holds one layer's keys and values of the longest context at once: fp32 ``[B, H, T, hd]``,
    a tiled copy, SDPA's operands (about 3x) and the packed pages beside them: checked before the model loads."""
    from oakenkv.assets.models import model_kv_shape
    from oakenkv.util.resources import check_memory

    if max(contexts) > MAX_TOKENS:
        raise bad_option("--context", f"at most {MAX_TOKENS} tokens, got {max(contexts)}")
    shape = model_kv_shape(model)
    if shape is None:
        return
    need = int(max(contexts) * batch * shape[1] * 2 * 4 * 3.5)
    what = f"--context {max(contexts)}" + (f" at batch {batch}" if batch > 1 else "")
    check_memory(need, what, "give shorter contexts")


def _point(values: list[int], **axes: Any) -> str:
    """A result's point name: ``ctx1024-4096_batch1`` from the lists and values a run covers."""
    parts = ["ctx" + "-".join(map(str, values))]
    for name, v in axes.items():
        if v:
            parts.append(name + "-".join(map(str, v if isinstance(v, list) else [v])))
    return "_".join(parts)


def _check_methods(methods: str) -> list[str]:
    """``--methods`` of the cache benchmarks: distinct names among :data:`_BENCH_METHODS`."""
    names = [m.strip() for m in methods.split(",") if m.strip()]
    if not names or len(set(names)) != len(names) or any(m not in _BENCH_METHODS for m in names):
        raise bad_option("--methods", f"give distinct methods among {', '.join(_BENCH_METHODS)}, got {methods!r}")
    return names


@bench_app.command("attention")
def bench_attention(
    context: Annotated[str, typer.Option(help="Comma-separated context lengths in tokens.")] = "1024,16384",
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8",
    threads: Annotated[str, typer.Option(help="Comma-separated thread counts (torch and numba).")] = "1,2",
    rounds: Annotated[int, typer.Option(help="Interleaved timing rounds (the best time is reported).", min=1)] = 5,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    save: Annotated[
        bool,
        typer.Option(help="Also save the result as benchmarks/results/<benchmark>/<point>.json (run metadata added)."),
    ] = False,
    thresholds: Annotated[
        Path | None, typer.Option(help="Thresholds file (default: a cached 16-window profile of the model).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model name (see `oakenkv info`).")] = "default",
) -> None:
    """Time the packed decode-attention kernel on one layer's real K/V and report the packed bytes it reads per
    second next to memcpy (same threads) and fp32 SDPA, measured in the same rounds."""
    from oakenkv.sim.report import parse_int_list

    contexts = parse_int_list(context, "--context")
    batches = parse_int_list(batch, "--batch")
    counts = parse_int_list(threads, "--threads")
    import numba

    if max(counts) > numba.config.NUMBA_NUM_THREADS:
        raise bad_option("--threads", f"numba has {numba.config.NUMBA_NUM_THREADS} threads; give at most that many")
    check_model(model)
    thr_file = load_thresholds(thresholds, model)
    check_out(json_out, "--json")
    check_save(save, "attention", _point(contexts, batch=batches, threads=counts))
    _check_attention_contexts(model, contexts, max(batches))
    start_run()
    from rich.console import Console

    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.models import load_model
    from oakenkv.bench.attention import print_attention_bench, run_attention_bench

    console = Console(stderr=True)
    with console.status("loading the model and thresholds") as status:
        thr = load_or_profile_thresholds(load_model(model), thr_file)
        result = run_attention_bench(
            contexts, batches, counts, model=model, thresholds=thr, rounds=rounds, progress=status.update
        )
    print_attention_bench(result)
    emit_result(result, json_out, save, "attention", _point(contexts, batch=batches, threads=counts))


@bench_app.command("generate")
def bench_generate(
    prompts: Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")] = "128,1024,4096,16384",
    batches: Annotated[str, typer.Option(help="Comma-separated batch sizes (every prompt with every batch).")] = "1,8",
    points: Annotated[
        str | None,
        typer.Option(help="Comma-separated PROMPTxBATCH points to run instead of the grid, e.g. '128x1,4096x8'."),
    ] = None,
    methods: Annotated[str, typer.Option(help=_BENCH_CACHES_HELP)] = "oaken,dynamic,quanto",
    new_tokens: Annotated[
        int, typer.Option(help="Tokens generated per row (greedy, end of sequence ignored).", min=2)
    ] = 64,
    rounds: Annotated[int, typer.Option(help="Timed generates per method and point (interleaved).", min=1)] = 3,
    residual: ResidualOption = 0,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for torch and numba (default: leave them as they are).", min=1)
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results to this JSON file.")] = None,
    save: Annotated[
        bool,
        typer.Option(help="Also save the result as benchmarks/results/<benchmark>/<point>.json (run metadata added)."),
    ] = False,
    thresholds: Annotated[
        Path | None, typer.Option(help="Thresholds file (default: a cached 16-window profile of the model).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model name (see `oakenkv info`).")] = "default",
) -> None:
    """Time model.generate end to end (prefill and decode tokens/s apart) for OakenCache, transformers'
    DynamicCache (fp32) and QuantizedCache (quanto int4) at several prompt lengths and batch sizes, in interleaved
    rounds with paired ratios. The full grid (16K-token prompts at batch 8) takes hours on a 2-core machine:
    select a subset with --prompts/--batches or --points."""
    from oakenkv.sim.report import parse_int_list

    names = _check_methods(methods)
    if thresholds is not None and "oaken" not in names:
        raise bad_option("--thresholds", "the thresholds are for the 'oaken' method, which --methods does not include")
    if residual and "oaken" not in names:
        raise bad_option("--residual", "the window is the 'oaken' method's, which --methods does not include")
    if points:
        try:
            grid = [tuple(int(x) for x in p.lower().split("x")) for p in points.split(",") if p.strip()]
        except ValueError:
            grid = []
        if not grid or any(len(p) != 2 or min(p) < 1 for p in grid):
            raise bad_option("--points", f"points are PROMPTxBATCH with positive integers, e.g. 128x1; got {points!r}")
    else:
        grid = [(p, b) for p in parse_int_list(prompts, "--prompts") for b in parse_int_list(batches, "--batches")]
    check_model(model)
    thr_file = load_thresholds(thresholds, model)
    check_out(json_out, "--json")
    point = "-".join(f"{p}x{b}" for p, b in grid) + (f"_residual{residual}" if residual else "")
    check_save(save, "generate", point)
    p_max, b_max = max(grid, key=lambda pb: (pb[0] + new_tokens) * pb[1])
    check_decode_contexts(model, [p_max + new_tokens], b_max, option="a prompt of")
    start_run()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from oakenkv.apps.generate import load_or_profile_thresholds
    from oakenkv.assets.models import load_model
    from oakenkv.bench.generate import print_generate_bench, run_generate_bench

    set_threads(threads)
    console = Console(stderr=True)
    with console.status("loading the model and thresholds"):
        thr = load_or_profile_thresholds(load_model(model), thr_file) if "oaken" in names else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("bench generate", total=None)

        def progress(done: int, total: int, message: str) -> None:
            bar.update(task, completed=done, total=total, description=message)

        result = run_generate_bench(
            points=grid, methods=names, model=model, thresholds=thr, new_tokens=new_tokens, rounds=rounds,
            residual=residual, progress=progress,
        )  # fmt: skip
    print_generate_bench(result)
    emit_result(result, json_out, save, "generate", point)
