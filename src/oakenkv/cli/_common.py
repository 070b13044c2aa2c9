"""What every command shares: the ``app``, the user-error rule (one ``error:`` line, exit code 2), argument
checks made before any work, and the options several commands take."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from oakenkv.util.paths import MAX_TEXT_BYTES

app = typer.Typer(
    name="oakenkv",
    help="Oaken KV-cache quantization (ISCA 2025): profile thresholds, quantize the KV cache of a transformers "
    "model into a fused dense-and-sparse format of about 5 bits per value, evaluate it against its peers and "
    "simulate the Oaken accelerator. Add --debug to any command to see a traceback with its error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


#: The ``--model`` option of every command that loads a model.
ModelOption = Annotated[
    str, typer.Option(help="Model: 'default', a Hugging Face id, a local directory or a .gguf path.")
]


#: Exit code of an error the user can fix (click's code for a usage error).
USER_ERROR = 2


#: Exception types a user causes: bad values (ValueError: every library validation, ThresholdsFileError,
#: ModelMismatchError, ModelFileError, CorruptDataError, ResourceLimitError), files (OSError: FileNotFoundError,
#: MissingModelError, DataNotFoundError, IsADirectoryError, PermissionError), memory (MemoryError, the page
#: pool's PoolExhaustedError) and a model the library cannot handle (NotImplementedError).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, MemoryError, NotImplementedError)


def one_line(text: str) -> str:
    """``text`` on one line, safe for a terminal: whitespace runs become one space, then every control or escape
    character left is made visible (``oakenkv.util.text.printable``: an error may quote a file's content)."""
    from oakenkv.util.text import printable

    return printable(" ".join(str(text).split()), limit=4000)


def message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.strerror}: {e.filename}"
    if isinstance(e, MemoryError) and not str(e):
        return "out of memory"
    return str(e) or type(e).__name__


def print_error(text: str) -> None:
    print(f"error: {one_line(text)}", file=sys.stderr, flush=True)


def show_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None):
    """Warnings as one ``warning: ...`` line each (no file name and source line: they are for the user)."""
    print(f"warning: {one_line(str(message))}", file=sys.stderr, flush=True)


def bad_option(option: str, message: str) -> typer.BadParameter:
    """A usage error naming the option (it becomes one ``error:`` line)."""
    return typer.BadParameter(message, param_hint=f"'{option}'")


def print_warning(text: str) -> None:
    """One ``warning: ...`` line on stderr (sanitized like an error line)."""
    print(f"warning: {one_line(text)}", file=sys.stderr, flush=True)


def check_out(path: Path | None, option: str) -> None:
    """Refuse an output path that cannot be written, before any work, by writing a trial file where the output will
    go (the nearest directory that exists): an existing directory, a parent that is a file, a directory without
    write permission, a read-only or full file system. An existing file there is replaced at the end: said now, in
    one ``warning:`` line (the policy of every ``--out``/``--json``/``--plot``, docs/robustness.md); an existing
    thing that is not a regular file (a device, a pipe) is refused."""
    if path is None:
        return
    if path.is_dir():
        raise bad_option(option, f"{path} is a directory; give a file name")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise bad_option(option, f"cannot create {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise bad_option(option, f"cannot write {path}: no permission to write in {parent}")
    import tempfile

    try:  # what the final write does (oakenkv.util.paths.atomic_write: a temporary file there, then a rename)
        fd, trial = tempfile.mkstemp(dir=parent, prefix=".oakenkv-trial-", suffix=".tmp")
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(trial)
    except OSError as e:
        raise bad_option(option, f"cannot write {path}: {message(e)}") from None
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise bad_option(option, f"{path} exists and is not a regular file (a device or a pipe?)")
        print_warning(f"{option} {path} exists; it will be replaced when the command ends")


def save_output(path: Path, write: Any, option: str) -> Path:
    """Write a command's output: ``write(p)`` writes it (atomically) to ``p``. When that fails after the work was
    done (the disk filled up, the directory went away or became read-only since :func:`check_out`), the output is
    written under the cache directory instead and the error names both: computed work is never lost."""
    try:
        write(path)
        return path
    except OSError as e:
        import time

        from oakenkv.util.paths import cache_root

        fallback = cache_root() / "unsaved" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{path.name}"
        try:
            write(fallback)
        except OSError:
            raise e from None
        raise OSError(f"could not write {option} {path} ({message(e)}); it was saved to {fallback} instead") from e


def check_input(
    path: Path | str | None, option: str, max_bytes: int | None = MAX_TEXT_BYTES, *, text: bool = False
) -> Path | None:
    """Refuse, before any work, a file to read that is missing, not a regular file (a directory, a FIFO that would
    block, a device such as /dev/zero that never ends), larger than ``max_bytes`` (default: the cap of a text read
    whole; None: any size, for a file read as a stream) or unreadable (``oakenkv.util.paths.check_input_file``);
    with ``text``, also one that is not UTF-8 text or holds none (read now: it was found after the model loaded)."""
    if path is None:
        return None
    from oakenkv.util.paths import InputFileError, check_input_file, read_text_capped

    try:
        p = check_input_file(path, "", max_bytes)
        if text and not read_text_capped(p, "", max_bytes or MAX_TEXT_BYTES).strip():
            raise InputFileError(f"{p} holds no text")
        return p
    except (FileNotFoundError, InputFileError) as e:
        raise bad_option(option, str(e)) from None


def check_model(model: str, option: str = "--model") -> None:
    """Resolve a model name without loading it (a missing package or path, a file that is no model)."""
    from oakenkv.assets.models import locate_model

    locate_model(model)


def load_thresholds(path: Path | None, model: str | None = None) -> Any:
    """Read and validate a thresholds file before anything expensive (None stays None); with ``model`` (its name),
    also refuse a profile of another shape than the model's, read from its config without loading it."""
    if path is None:
        return None
    from oakenkv.calibrate.thresholds import Thresholds

    th = Thresholds.load(path)
    if model is not None:
        from oakenkv.calibrate.match import check_profile_shape

        check_profile_shape(th, model)
    return th


#: The most tokens a window, a context or a full-precision window may ask for on the command line (no model reads
#: more): a larger number is refused before the model loads, not after minutes of tokenizing.
MAX_TOKENS = 1 << 20
#: The most calibration windows (profiling runs) an option may ask for; the paper uses about 100.
MAX_WINDOWS = 100_000

#: ``--residual`` of the commands that build an OakenCache (``OakenCache(residual=...)``, docs/pages.md).
ResidualOption = Annotated[
    int,
    typer.Option(
        help="OakenCache's full-precision window: its newest RESIDUAL to 2*RESIDUAL-1 tokens per layer stay "
        "unquantized (float32) and are encoded RESIDUAL at a time (KIVI's and QuantizedCache's residual). "
        "0: every token quantized on arrival, the paper's Oaken.",
        min=0,
        max=MAX_TOKENS,
    ),
]


def check_decode_contexts(model: str, contexts: list[int], batch: int = 1, option: str = "--context") -> None:
    """``bench decode --context`` (and ``bench generate``'s prompts): every method's cache of the longest context
    is held at once (fp32 K/V for DynamicCache, about a third of that for the others), so check the memory before
    loading anything."""
    from oakenkv.assets.models import model_kv_shape
    from oakenkv.util.resources import check_memory

    shape = model_kv_shape(model)
    if shape is None:  # a model not converted yet: its shape is known only once it loads
        return
    layers, dim = shape
    need = int(max(contexts) * batch * layers * dim * 2 * 4 * 1.5)
    what = f"{option} {max(contexts)}" + (f" at batch {batch}" if batch > 1 else "")
    check_memory(need, what, "give shorter contexts")


def set_threads(threads: int | None) -> None:
    if threads is not None:
        import numba
        import torch

        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def calib_spec(
    calib_text: str | None,
    calib_samples: int | None,
    calib_window: int | None,
    calib_path: str | None,
    *,
    method: str = "oaken",
    thresholds: Path | None = None,
):
    """The calibration spec from the --calib-* options (None: the default), validated; refused with --thresholds
    for Oaken, whose thresholds then come from the file (the options would be recorded and ignored)."""
    from oakenkv.calibrate.spec import DEFAULT_CALIB_SAMPLES, DEFAULT_CALIB_TEXT, DEFAULT_CALIB_WINDOW, CalibrationSpec
    from oakenkv.methods.registry import FAMILIES, parse_spec

    given = [
        o
        for o, v in (
            ("--calib-text", calib_text),
            ("--calib-samples", calib_samples),
            ("--calib-window", calib_window),
            ("--calib-path", calib_path),
        )
        if v is not None
    ]
    if thresholds is not None and given and FAMILIES[parse_spec(method)[0]].profile is not None:
        raise bad_option(given[0], "the thresholds come from --thresholds, so calibration options do not apply")
    try:
        family = FAMILIES[parse_spec(method)[0]]
    except ValueError:  # (a bad spec is refused with its own message next)
        family = None
    if given and family is not None and not family.calibrates:
        raise bad_option(given[0], f"{family.name} calibrates nothing, so calibration options do not apply")
    if calib_path is not None and calib_text is None:
        calib_text = "file"
    check_input(calib_path, "--calib-path", text=True)  # read whole: regular, capped, text (a FIFO hung the run)
    return CalibrationSpec(
        DEFAULT_CALIB_TEXT if calib_text is None else calib_text,
        DEFAULT_CALIB_SAMPLES if calib_samples is None else calib_samples,
        DEFAULT_CALIB_WINDOW if calib_window is None else calib_window,
        calib_path,
    )


def write_json(obj: dict, path: Path | None, option: str = "--json") -> None:
    """``obj`` as JSON to ``path`` (:func:`save_output`: never lost), or on stdout when ``path`` is None."""
    import json

    text = json.dumps(obj, indent=2)
    if path is None:
        typer.echo(text)
        return
    from oakenkv.util.paths import atomic_write

    wrote = save_output(path, lambda p: atomic_write(p, text + "\n"), option)
    typer.echo(f"wrote {wrote}")


def start_run() -> None:
    """Note a benchmark's start (time, load) for the metadata of its saved result (``oakenkv.bench.results``)."""
    from oakenkv.bench.results import start

    start()


def emit_result(result: dict, json_out: Path | None, save: bool, benchmark: str, point: str) -> None:
    """Write a benchmark's result to ``--json`` (:func:`save_output`: never lost) and, with ``--save``, to its one
    current file under ``benchmarks/results/<benchmark>/<point>.json`` with the run's metadata
    (``oakenkv.bench.results``)."""
    import json

    from oakenkv.bench.results import meta, result_path
    from oakenkv.bench.results import save as save_result

    if json_out is not None:
        from oakenkv.util.paths import atomic_write

        text = json.dumps({**result, "run": meta()}, indent=2, default=str) + "\n"
        typer.echo(f"wrote {save_output(json_out, lambda p: atomic_write(p, text), '--json')}")
    if save:
        where = result_path(benchmark, point)
        saved = save_output(where, lambda p: save_result(benchmark, point, result, path=p), "--save")
        typer.echo(f"wrote {saved}")


def check_save(save: bool, benchmark: str, point: str) -> None:
    """:func:`check_out` for ``--save``'s file (``benchmarks/results/<benchmark>/<point>.json``), before work."""
    if save:
        from oakenkv.bench.results import result_path

        check_out(result_path(benchmark, point), "--save")
