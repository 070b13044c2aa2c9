"""Where oakenkv finds and keeps files: its cache directory, installed packages' files, file digests.

Standard library only, so that ``oakenkv.data`` (no torch) and ``oakenkv.models`` share one definition of each.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path


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
