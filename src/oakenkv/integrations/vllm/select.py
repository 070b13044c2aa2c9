"""What vLLM's ``CPU_ATTN`` backend resolves to in this process: the Oaken backend or vLLM's own.

:func:`oakenkv.integrations.vllm.register` points ``CPU_ATTN`` at ``oakenkv.integrations.vllm.select.Backend``.
vLLM resolves that name (``resolve_obj_by_qualname``: import this module, then ``getattr``) in the worker while it
builds the model, under the engine's config (``get_current_vllm_config``), so the served model is known here: the
module's ``__getattr__`` (PEP 562) decides with :func:`oakenkv.integrations.vllm.activate` and returns
``OakenAttentionBackend`` when a profile serves the model (``OAKENKV_VLLM_PROFILE``, or ``oakenkv-profile.json`` in
the served directory), else vLLM's own ``CPU_ATTN`` class, unchanged. vLLM caches the answer per process.

``CudaBackend`` is the same decision for vLLM's CUDA engine, whose platform walks ``FLASH_ATTN`` first: the Oaken
device backend (``cuda.OakenCudaAttentionBackend``) or vLLM's own FlashAttention class. On the CPU engine
``OAKENKV_VLLM_KERNELS=triton`` picks the device backend too (its Triton kernels on CPU tensors).
"""

from __future__ import annotations

from typing import Any


def backend_class(platform: str = "cpu") -> type:
    """The attention backend class for the model the current vLLM config serves (module docstring) on vLLM's CPU
    engine (``platform="cpu"``: in place of ``CPU_ATTN``) or its CUDA engine (``"cuda"``: of ``FLASH_ATTN``)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from oakenkv.integrations.vllm import activate

    config = get_current_vllm_config_or_none()
    model_config = getattr(config, "model_config", None)
    model_dir = getattr(model_config, "model", None)
    hf_config = getattr(model_config, "hf_config", None)
    settings = activate(model_dir, hf_config)
    own = AttentionBackendEnum.CPU_ATTN if platform == "cpu" else AttentionBackendEnum.FLASH_ATTN
    if settings is None:
        return resolve_obj_by_qualname(own.value)
    from oakenkv.integrations.vllm.backend import logger

    logger.info("Oaken KV cache: profile %s checked against the served model %s", settings.profile, model_dir)
    if platform == "cpu" and settings.kernels == "numba":
        from oakenkv.integrations.vllm.backend import OakenAttentionBackend

        return OakenAttentionBackend
    if platform == "cpu":
        import torch

        from oakenkv.integrations.vllm._oaken import interpreting

        if not interpreting() and not torch.cuda.is_available():  # (Triton finds no driver at the first request)
            raise ValueError(
                "OAKENKV_VLLM_KERNELS=triton on vLLM's CPU engine runs the Triton kernels on CPU tensors, which needs "
                "Triton's interpreter (TRITON_INTERPRET=1, slow: for tests) or a GPU; leave it unset for the numba "
                "kernels"
            )
    from oakenkv.integrations.vllm.cuda import OakenCudaAttentionBackend

    return OakenCudaAttentionBackend


def __getattr__(name: str) -> Any:
    if name == "Backend":
        return backend_class("cpu")
    if name == "CudaBackend":
        return backend_class("cuda")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
