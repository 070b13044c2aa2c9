"""Where oakenkv finds and keeps files: its cache directory, installed packages' files, file digests, and how it
writes them (:func:`atomic_write`: whole or not at all, with the permissions of a plain ``open``).

Standard library only, so that ``oakenkv.assets.data`` (no torch) and ``oakenkv.assets.models`` share one definition of
each.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


def cache_root() -> Path:
    """The oakenkv cache directory: ``$OAKENKV_CACHE`` when set, else ``~/.cache/oakenkv``."""
    env = os.environ.get("OAKENKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "oakenkv"


def package_dir(package: str) -> Path | None:
    """The directory of an installed package, found without importing it (None when not installed).

    The packages that ship the embedded model and data are located with :func:`importlib.util.find_spec` and
    never imported: only their files are needed.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 hex digest of a file, memoised by (resolved path, size, mtime): large files take a while to hash."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _SHA_MEMO:
        h = hashlib.sha256()
        with p.open("rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        _SHA_MEMO[key] = h.hexdigest()
    return _SHA_MEMO[key]


def umask() -> int:
    """The process's umask, read without changing it where Linux allows (``/proc/self/status``); elsewhere set and
    restored at once (a race only with another thread creating files in that instant)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file: ``0o666`` less the umask (``tempfile`` gives 0600,
    which would keep a shared cache's files from its other users)."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode ``os.mkdir`` gives a new directory: ``0o777`` less the umask (``tempfile.mkdtemp`` gives 0700)."""
    return 0o777 & ~umask()


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """A binary file to write ``path`` through: a temporary file in the same directory, flushed to disk, then
    renamed over ``path`` when the block ends without an exception (removed otherwise).

    A reader, a concurrent writer or an interruption (Ctrl-C, a crash, a full disk) never leaves a torn
    ``path``: it holds the old content or the whole new one. The file gets :func:`file_mode` (the umask's mode,
    as a plain ``open`` would), and missing parent directories are created.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())
        os.replace(tmp, p)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike[str], data: str | bytes | Callable[[IO[bytes]], object]) -> Path:
    """Write ``data`` (text as UTF-8, bytes, or a function writing to a binary file, e.g. ``lambda f:
    torch.save(obj, f)``) to ``path`` with :func:`atomic_writer`; returns the path."""
    with atomic_writer(path) as f:
        if isinstance(data, str):
            f.write(data.encode("utf-8"))
        elif isinstance(data, (bytes, bytearray, memoryview)):
            f.write(data)
        else:
            data(f)
    return Path(path)


class InputFileError(ValueError):
    """A file given to read is not one: a directory, a pipe or a device, too large, unreadable, not text."""


#: Largest text file read whole as calibration or evaluation text (``--calib-path``, ``--data-path``): the paper's
#: calibration is a few hundred thousand tokens; 256 MB of text is millions of windows.
MAX_TEXT_BYTES = 256 * 2**20
#: Largest JSON result or header file ``eval report`` reads.
MAX_RESULT_BYTES = 64 * 2**20


def _named(what: str, p: Path) -> str:
    return f"{what} {p}" if what else str(p)


def check_input_file(path: str | os.PathLike[str], what: str, max_bytes: int | None) -> Path:
    """Refuse, before any work, a path that cannot be read as a file of at most ``max_bytes`` (None: any size):
    missing (``FileNotFoundError``), or not a regular file (a directory, a FIFO that would block, a device such as
    ``/dev/zero`` that never ends), too large, or unreadable (:class:`InputFileError`, a ValueError). ``what``
    names the input in the message (``"--calib-path"``). Returns the path."""
    p = Path(path)
    try:
        st = os.stat(p)  # (follows links: a link to /dev/zero is /dev/zero)
    except FileNotFoundError:
        raise FileNotFoundError(f"{_named(what, p)} does not exist") from None
    except OSError as e:
        raise InputFileError(f"{_named(what, p)} cannot be read: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputFileError(f"{_named(what, p)} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(f"{_named(what, p)} is not a regular file (a pipe or a device?); give a file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise InputFileError(f"{_named(what, p)} holds {st.st_size:,} bytes, more than the {max_bytes:,} read at most")
    if not os.access(p, os.R_OK):
        raise InputFileError(f"{_named(what, p)} cannot be read: no permission")
    return p


def read_text_capped(path: str | os.PathLike[str], what: str, max_bytes: int) -> str:
    """The UTF-8 text of ``path`` after :func:`check_input_file` (newlines as ``Path.read_text`` gives them), reading
    at most ``max_bytes``: a file that grew past it since the check is refused, not read on. :class:`InputFileError`
    for text that is not UTF-8."""
    p = check_input_file(path, what, max_bytes)
    with p.open("rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputFileError(f"{_named(what, p)} holds more than the {max_bytes:,} bytes read at most")
    try:  # universal newlines, as Path.read_text reads (the same text, so the same tokens and cache keys)
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{_named(what, p)} is not UTF-8 text ({e.reason} at byte {e.start})") from None
