"""The offline half: a model's profile, made once from calibration text, read by every cache.

- ``thresholds``: :class:`Thresholds`, the profile's file format (schema, model fingerprint, per-layer
  thresholds and statistics, oaken-plus transforms), validation, ``weights_digest``.
- ``profile``: the profiler (K/V recording, per-run statistics) and its content-keyed disk cache.
- ``plus``: the ``oaken-plus`` search (per-layer transforms and ratios chosen by attention-output error).
- ``transforms``: the transforms' record, folding into weights, the online key transform.
- ``match``: the one check of a profile against a model (shape, weights, transforms) every constructor runs.
- ``spec``: :class:`CalibrationSpec` (which text, how much); ``rope``: RoPE as the models apply it;
  ``ranges``: the peers' calibration (KVQuant's and the official harness's ranges).
"""

from oakenkv._lazy import exports

__getattr__, __dir__, __all__ = exports(
    __name__,
    {
        "CalibrationSpec": "calibrate.spec",
        "ModelMismatchError": "calibrate.thresholds",
        "Thresholds": "calibrate.thresholds",
        "ThresholdsFileError": "calibrate.thresholds",
        "weights_digest": "calibrate.thresholds",
        "cached_thresholds": "calibrate.profile",
        "profile_model": "calibrate.profile",
        "apply_profile": "calibrate.plus",
        "cached_plus_profile": "calibrate.plus",
        "profile_plus": "calibrate.plus",
    },
)
