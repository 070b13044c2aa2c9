"""What a served model directory holds, by content: the digest of its safetensors weights and the profile inside it.

``oakenkv export`` writes a Hugging Face directory with the profile's weight transforms folded in and its profile
as ``oakenkv-profile.json``, recording in that profile the digest of the weights it wrote (:func:`weights_digest`).
The plugin compares that record with the weights vLLM is about to serve, computed again from the files: a profile
is accepted for the weights it was made for, whatever the paths (a directory copied elsewhere serves; a profile
next to other weights is refused).

Imports nothing of oakenkv, vLLM, torch or numba: the plugin calls it while vLLM starts.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: The profile's file name inside an exported directory.
PROFILE_FILE = "oakenkv-profile.json"
#: Key of the export record in the profile's free-form ``profile`` metadata.
EXPORT_KEY = "export"
DIGEST_PREFIX = "sha256:"


class ServedWeightsError(ValueError):
    """The served directory's weights cannot be read, or are not the ones a profile was made for."""


def _tensors(path: Path) -> list[tuple[str, str, list[int], int, int]]:
    """``(name, dtype, shape, start, end)`` of every tensor of a safetensors file (byte range in the file)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ServedWeightsError(f"{path}: not a safetensors file (shorter than its header length)")
        n = int.from_bytes(head, "little")
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:
            raise ServedWeightsError(f"{path}: not a safetensors file (header of {n} bytes in a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ServedWeightsError(f"{path}: not a safetensors file ({e})") from None
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        if not 0 <= a <= b <= size - 8 - n:
            raise ServedWeightsError(f"{path}: tensor {name!r} lies outside the file")
        out.append((name, str(entry["dtype"]), list(entry["shape"]), 8 + n + a, 8 + n + b))
    return out


def weights_digest(directory: str | os.PathLike[str]) -> str:
    """``"sha256:<hex>"`` of the weights in ``directory``'s ``*.safetensors`` files, by content: one line ``name,
    dtype, shape, sha256 of the tensor's bytes`` per tensor in name order (how the tensors are split over files,
    ordered inside them, or what metadata the files carry does not count), hashed together.

    Raises :class:`ServedWeightsError` when the directory holds no safetensors file, a file is not one, or a tensor
    name appears twice."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ServedWeightsError(f"{directory}: no *.safetensors weights to check the profile against")
    where: dict[str, tuple[Path, str, list[int], int, int]] = {}
    for path in files:
        for name, dtype, shape, a, b in _tensors(path):
            if name in where:
                raise ServedWeightsError(f"{directory}: tensor {name!r} is in {where[name][0].name} and {path.name}")
            where[name] = (path, dtype, shape, a, b)
    maps = {}
    try:
        for path in files:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size:
                    maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

        def one(name: str) -> str:
            path, _, _, a, b = where[name]
            if a == b:
                return hashlib.sha256(b"").hexdigest()
            view = memoryview(maps[path])
            try:
                return hashlib.sha256(view[a:b]).hexdigest()  # hashlib releases the GIL on large buffers
            finally:
                view.release()

        names = sorted(where)
        order = sorted(names, key=lambda k: where[k][3] - where[k][4])  # the largest first: threads end together
        with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
            digests = dict(zip(order, pool.map(one, order), strict=True))
    finally:
        for m in maps.values():
            m.close()
    h = hashlib.sha256()
    for name in names:
        _, dtype, shape, _, _ = where[name]
        h.update(f"{name}\t{dtype}\t{shape}\t{digests[name]}\n".encode())
    return DIGEST_PREFIX + h.hexdigest()


def export_record(profile_metadata: dict) -> dict | None:
    """The export record of a profile's metadata (``Thresholds.profile``), or None when it was not exported."""
    rec = profile_metadata.get(EXPORT_KEY) if isinstance(profile_metadata, dict) else None
    return rec if isinstance(rec, dict) else None


def check_weights(profile_metadata: dict, directory: str | os.PathLike[str], source: str) -> str:
    """Raise :class:`ServedWeightsError` unless the weights in ``directory`` are the ones the profile (metadata
    ``profile_metadata``, read from ``source``) was exported with; returns their digest."""
    rec = export_record(profile_metadata)
    if rec is None or not isinstance(rec.get("weights"), str):
        raise ServedWeightsError(f"{source}: this profile records no exported weights (make one with `oakenkv export`)")
    got = weights_digest(directory)
    if got != rec["weights"]:
        raise ServedWeightsError(
            f"{source} was exported with other weights ({rec['weights'][:19]}...) than the ones served from "
            f"{directory} ({got[:19]}...); serve the directory `oakenkv export` wrote, or export this model again"
        )
    return got


__all__ = ["EXPORT_KEY", "PROFILE_FILE", "ServedWeightsError", "check_weights", "export_record", "weights_digest"]
