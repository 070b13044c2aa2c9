"""The calibration disk cache: results made once from calibration text, kept on disk keyed by content.

Every calibration result (the paper's thresholds, ``oakenkv.calibrate.profile.cached_thresholds``; the oaken-plus
profiles, ``oakenkv.calibrate.plus.cached_plus_profiles``; the peers' KV ranges, ``oakenkv.calibrate.ranges``) is
one :class:`CacheEntry`: what it was computed from (:class:`CalibrationKey`: the model's shape and weights digest,
and the token ids of the calibration windows), what was computed (a kind and its named parameters), and so one
file under :func:`profile_cache_dir`, named ``<kind>-<model>-<calibration>[<label>]-<digest>.<suffix>`` with the
digest of all of it. The file records the same identity, and :meth:`CacheEntry.load` compares it with the entry's
when it reads the file: a file copied or renamed under another entry's name, or written by another model of the same
name, is not served; it is computed again (a warning names what differs) and overwritten. Files are written
atomically (``oakenkv.util.paths.atomic_write``): a reader never sees half of one.

Profiles (thresholds files) record their identity in their own fields: the model fingerprint, the profile's
``windows_sha256`` and ``kurtosis_tuning``, the config, the transforms' ``search`` (:func:`profile_identity`);
other files record an ``identity`` object (:meth:`CacheEntry.identity`). A profile is also kept under the model's
weights rounded to bfloat16 (:func:`rounded_entry`), where the same weights loaded in the other dtype find it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from oakenkv.calibrate.identity import ModelFingerprint, rounded_weights_digest
from oakenkv.calibrate.spec import CalibrationSpec
from oakenkv.calibrate.thresholds import Thresholds
from oakenkv.format.config import OakenConfig
from oakenkv.util.paths import atomic_write, cache_root

if TYPE_CHECKING:
    import torch

__all__ = [
    "CacheEntry",
    "CalibrationKey",
    "calibration_key",
    "load_cached_thresholds",
    "load_profile_of_other_dtype",
    "profile_cache_dir",
    "profile_identity",
    "rounded_entry",
    "store_profile",
    "thresholds_cache_path",
    "thresholds_entry",
]

T = TypeVar("T")


def profile_cache_dir() -> Path:
    """Where calibration results are kept: ``oakenkv.util.paths.cache_root() / "eval"`` (named after the
    evaluation, which kept them there first; the name stays so that existing caches stay valid)."""
    d = cache_root() / "eval"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _model_identity(fingerprint: ModelFingerprint) -> dict[str, Any]:
    """The compared part of a fingerprint: shape and weights digest (not the name it was loaded by, nor the rounded
    digest a newer profile records beside the weights': keys and files of earlier profiles stay as they were)."""
    return {k: v for k, v in fingerprint.to_dict().items() if k not in ("name", "weights_bf16")}


@dataclass(frozen=True)
class CalibrationKey:
    """What a cached calibration result depends on, by content: the model's shape and weights
    (:class:`~oakenkv.calibrate.identity.ModelFingerprint` with :func:`~oakenkv.calibrate.identity.weights_digest`)
    and the token ids of the calibration windows (which carry the text's content, the tokenizer, BOS, the window
    count and length). ``model_name`` and ``spec`` only make the cache's file names readable: two models loaded by
    one name, or one text file edited in place, get different keys.
    """

    model_name: str
    fingerprint: ModelFingerprint
    spec: CalibrationSpec
    #: sha256 of the windows' int64 token ids.
    windows_sha256: str

    def digest(self, *extra: Any) -> str:
        """sha256 (hex) of the key's content and ``extra`` (JSON-able: the config, tuning, ...)."""
        payload = json.dumps(
            [_model_identity(self.fingerprint), self.windows_sha256, *extra], sort_keys=True, default=str
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def stem(self) -> str:
        """The readable part of a cache file's name: ``<model>-<spec tag>``."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.model_name)[-60:]
        return f"{safe}-{self.spec.tag()}"


def calibration_key(model: Any, model_name: str, spec: CalibrationSpec, windows: torch.Tensor) -> CalibrationKey:
    """The :class:`CalibrationKey` of ``model`` (shape and :func:`~oakenkv.calibrate.identity.weights_digest`) over
    the calibration ``windows`` (int64 ``[R, S]``: ``oakenkv.calibrate.spec.calibration_windows`` of ``spec``)."""
    import torch

    ids = windows.detach().to(torch.int64).contiguous()
    return CalibrationKey(
        model_name,
        ModelFingerprint.from_model(model, name=model_name),
        spec,
        hashlib.sha256(ids.numpy().tobytes() + repr(tuple(ids.shape)).encode()).hexdigest(),
    )


@dataclass(frozen=True)
class CacheEntry:
    """One calibration result's place in the cache (module doc).

    ``params`` name what was computed (JSON-able values, e.g. ``{"config": ..., "kurtosis tuning": False}``):
    they are compared with the file's when it is read. ``digest_of`` is what the file name's digest hashes
    besides the key: the same parameters, in the form each kind has always used, so that files cached by earlier
    versions keep their names.
    """

    key: CalibrationKey
    #: The kind of result: the file name's first part ("thr", "plus", "ranges").
    kind: str
    params: dict[str, Any]
    digest_of: tuple[Any, ...]
    suffix: str = ".json"
    #: An extra readable part of the file name (e.g. "-q0.005").
    label: str = ""
    #: Default :func:`profile_cache_dir` (looked up when the path is asked for).
    directory: Path | None = None

    @property
    def digest(self) -> str:
        return self.key.digest(*self.digest_of)

    @property
    def path(self) -> Path:
        directory = profile_cache_dir() if self.directory is None else Path(self.directory)
        return directory / f"{self.kind}-{self.key.stem()}{self.label}-{self.digest[:16]}{self.suffix}"

    def identity(self) -> dict[str, Any]:
        """What the file must record: the model, the calibration windows and ``params``, by name."""
        return {
            "model": _model_identity(self.key.fingerprint),
            "calibration windows": self.key.windows_sha256,
            **json.loads(json.dumps(self.params)),  # as a JSON file holds them (tuples as lists)
        }

    def load(
        self,
        read: Callable[[Path], T],
        recorded: Callable[[T], Any],
        noun: str,
        redo: str,
        *,
        path: Path | None = None,
        quiet: bool = False,
    ) -> T | None:
        """The result cached at ``path`` (default :attr:`path`) if the identity it records (``recorded`` of what
        ``read`` returns) is this entry's, else None: no file; an unreadable one (any exception of ``read``); one
        made for another model, calibration or parameters. Each but the first warns (unless ``quiet``), e.g.
        "the cached profile ... was made for another model; profiling again" (``noun``, ``redo``)."""
        path = self.path if path is None else path
        if not path.is_file():
            return None
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore")
            try:
                obj = read(path)
            except Exception as e:  # any unreadable file: compute again rather than fail every later run
                warnings.warn(
                    f"ignoring the unreadable cached {noun} {path} ({type(e).__name__}: {e}); {redo}", stacklevel=3
                )
                return None
            have, want = recorded(obj), self.identity()
            if not isinstance(have, dict):
                have = {}
            differ = [name for name in want if have.get(name) != want[name]]
            if differ:
                warnings.warn(
                    f"the cached {noun} {path} was made for another {', '.join(differ)}; {redo}", stacklevel=3
                )
                return None
        return obj

    def store(self, data: str | bytes | Callable[[IO[bytes]], object], path: Path | None = None) -> Path:
        """Write the result atomically (``data``: the file's text or bytes, or a function writing it)."""
        return atomic_write(self.path if path is None else path, data)


# ----------------------------------------------------------------------------------------------- profiles


def profile_identity(th: Thresholds) -> dict[str, Any]:
    """The identity a profile file records, in :meth:`CacheEntry.identity`'s names."""
    return {
        "model": _model_identity(th.fingerprint),
        "calibration windows": th.profile.get("windows_sha256"),
        "config": th.config.to_dict(),
        "kurtosis tuning": bool(th.profile.get("kurtosis_tuning")),
        "search": None if th.transforms is None else th.transforms.notes.get("search"),
    }


def load_profile(entry: CacheEntry, path: Path | None = None, *, quiet: bool = False) -> Thresholds | None:
    """:meth:`CacheEntry.load` of a profile (a thresholds file)."""
    return entry.load(Thresholds.load, profile_identity, "profile", "profiling again", path=path, quiet=quiet)


def rounded_entry(entry: CacheEntry, rounded: str) -> CacheEntry:
    """Where a profile of ``entry`` is also kept under the model's weights rounded to bfloat16: ``entry`` with the
    weights digest replaced by ``rounded`` (``identity.rounded_weights_digest``) and ``-bf16`` in the file name. A
    profile made on a float32 model is found there for its bfloat16 copy, and the reverse
    (:func:`store_profile`, :func:`load_profile_of_other_dtype`)."""
    fp = replace(entry.key.fingerprint, weights=rounded, weights_bf16=None)
    return replace(entry, key=replace(entry.key, fingerprint=fp), label=f"{entry.label}-bf16")


def _rounded_identity(th: Thresholds) -> dict[str, Any]:
    """:func:`profile_identity` with the model's rounded weights digest in place of its own (:func:`rounded_entry`)."""
    identity = profile_identity(th)
    identity["model"] = {**identity["model"], "weights": th.fingerprint.weights_bf16}
    return identity


def store_profile(entry: CacheEntry, th: Thresholds) -> Path:
    """Write profile ``th`` to ``entry``'s file and, when it records its weights' rounded digest, to the
    :func:`rounded_entry` too."""
    path = entry.store(th.to_json())
    if th.fingerprint.weights_bf16 is not None:
        rounded_entry(entry, th.fingerprint.weights_bf16).store(th.to_json())
    return path


def load_profile_of_other_dtype(entry: CacheEntry, model: Any) -> Thresholds | None:
    """The profile of ``entry`` made on ``model``'s weights in another dtype (same weights when rounded to bfloat16;
    :func:`rounded_entry`), or None. Checked as :func:`load_profile` checks, with the rounded digests in place of
    the weights'; the caller's model check then accepts it with ``OtherDtypeWarning``."""
    alias = rounded_entry(entry, rounded_weights_digest(model))
    found = alias.load(Thresholds.load, _rounded_identity, "profile", "profiling again")
    if found is not None and found.fingerprint.weights == entry.key.fingerprint.weights:
        entry.store(found.to_json())  # the model's own profile, its file lost or overwritten: put back
    return found


def thresholds_entry(
    key: CalibrationKey, config: OakenConfig, kurtosis_tuning: bool = False, cache_dir: Path | None = None
) -> CacheEntry:
    """The entry of the paper's thresholds (``oakenkv.calibrate.profile.profile_thresholds``) for ``config`` and
    ``kurtosis_tuning`` over ``key``'s model and windows."""
    return CacheEntry(
        key,
        "thr",
        {"config": config.to_dict(), "kurtosis tuning": bool(kurtosis_tuning)},
        (config.to_dict(), bool(kurtosis_tuning)),
        directory=cache_dir,
    )


def thresholds_cache_path(
    key: CalibrationKey, config: OakenConfig, kurtosis_tuning: bool = False, cache_dir: Path | None = None
) -> Path:
    """The file ``oakenkv.calibrate.profile.cached_thresholds`` keeps a profile in (:func:`thresholds_entry`)."""
    return thresholds_entry(key, config, kurtosis_tuning, cache_dir).path


def load_cached_thresholds(
    path: Path, key: CalibrationKey, config: OakenConfig, kurtosis_tuning: bool = False
) -> Thresholds | None:
    """The profile cached at ``path`` if it is the one ``key``, ``config`` and ``kurtosis_tuning`` ask for, else
    None (:meth:`CacheEntry.load`: no file, an unreadable one, or one made for another model, weights, windows,
    config or tuning, which warns)."""
    return load_profile(thresholds_entry(key, config, kurtosis_tuning), path)
