"""What vLLM's ``CPU_ATTN`` backend resolves to in this process: the Oaken backend or vLLM's own.

:func:`oakenkv.integrations.vllm.register` points ``CPU_ATTN`` at ``oakenkv.integrations.vllm.select.Backend``.
vLLM resolves that name (``resolve_obj_by_qualname``: import this module, then ``getattr``) in the worker while it
builds the model, under the engine's config (``get_current_vllm_config``), so the served model is known here: the
module's ``__getattr__`` (PEP 562) decides with :func:`oakenkv.integrations.vllm.activate` and returns
``OakenAttentionBackend`` when a profile serves the model (``OAKENKV_VLLM_PROFILE``, or ``oakenkv-profile.json`` in
the served directory), else vLLM's own ``CPU_ATTN`` class, unchanged. vLLM caches the answer per process.
"""

from __future__ import annotations

from typing import Any


def backend_class() -> type:
    """The attention backend class for the model the current vLLM config serves (module docstring)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from oakenkv.integrations.vllm import activate

    config = get_current_vllm_config_or_none()
    model_config = getattr(config, "model_config", None)
    model_dir = getattr(model_config, "model", None)
    hf_config = getattr(model_config, "hf_config", None)
    settings = activate(model_dir, hf_config)
    if settings is None:
        return resolve_obj_by_qualname(AttentionBackendEnum.CPU_ATTN.value)
    from oakenkv.integrations.vllm.backend import OakenAttentionBackend, logger

    logger.info("Oaken KV cache: profile %s checked against the served model %s", settings.profile, model_dir)

    return OakenAttentionBackend


def __getattr__(name: str) -> Any:
    if name == "Backend":
        return backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
