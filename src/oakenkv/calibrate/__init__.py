"""The offline half: a model's profile, made once from calibration text, read by every cache.

- ``thresholds``: :class:`Thresholds`, the profile's file format (schema, per-layer thresholds and statistics,
  oaken-plus transforms) and validation; ``identity``: the model it belongs to (``ModelFingerprint``,
  ``weights_digest``).
- ``profile``: the paper's profiler; ``stats``: its per-run quantiles and kurtosis, averaged over runs;
  ``recording``: what the attention layers receive (the cache's K/V; the oaken-plus search's queries, keys and
  values, one layer at a time).
- ``plus``: the ``oaken-plus`` profile (layer by layer) and applying it; ``search``: one layer's candidates and
  their scoring by attention-output error; ``transforms``: the transforms' record, folding into weights, the
  online key transform.
- ``diskcache``: the one content-keyed disk cache of every calibration result.
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
        "weights_digest": "calibrate.identity",
        "cached_thresholds": "calibrate.profile",
        "profile_model": "calibrate.profile",
        "apply_profile": "calibrate.plus",
        "cached_plus_profile": "calibrate.plus",
        "profile_plus": "calibrate.plus",
    },
)
