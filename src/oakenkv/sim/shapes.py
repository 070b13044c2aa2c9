"""Model shapes for the simulator: enough architecture to count weight bytes, KV bytes and FLOPs.

Numbers are the public ``config.json`` values of each model. Parameter counts are derived from the shape (not
typed in) and tests check them against the published totals (e.g. Llama2-7B 6.74 B).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """Architecture of a decoder-only transformer.

    ffn: "gated" (SwiGLU, three d_model x d_ffn matrices: Llama, Mistral, Qwen) or "mlp" (two matrices: OPT).
    n_experts / experts_per_token: mixture of experts (1 / 1 for dense models); every expert has one full FFN.
    sliding_window: attention window in tokens (None = full attention); the KV cache keeps at most this many.
    tied_embeddings: the LM head shares the input embedding matrix.
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ffn: int
    vocab: int
    ffn: str = "gated"
    n_experts: int = 1
    experts_per_token: int = 1
    sliding_window: int | None = None
    tied_embeddings: bool = False
    max_position: int = 4096

    def __post_init__(self) -> None:
        for attr in (
            "n_layers",
            "d_model",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ffn",
            "vocab",
            "n_experts",
            "experts_per_token",
            "max_position",
        ):
            if getattr(self, attr) < 1:
                raise ValueError(f"model {self.name!r}: {attr} must be >= 1, got {getattr(self, attr)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model {self.name!r}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.ffn not in ("gated", "mlp"):
            raise ValueError(f"model {self.name!r}: ffn must be 'gated' or 'mlp', got {self.ffn!r}")
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"model {self.name!r}: experts_per_token > n_experts")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model {self.name!r}: sliding_window must be >= 1 or None")

    # ---- parameter counts (weights only; norms and biases are < 0.1% and ignored) ----
    @property
    def attn_params_per_layer(self) -> int:
        q_o = 2 * self.d_model * self.n_heads * self.head_dim
        k_v = 2 * self.d_model * self.n_kv_heads * self.head_dim
        return q_o + k_v

    @property
    def expert_params(self) -> int:
        """Parameters of one FFN (one expert)."""
        return (3 if self.ffn == "gated" else 2) * self.d_model * self.d_ffn

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.d_model

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.d_model

    @property
    def total_params(self) -> int:
        per_layer = self.attn_params_per_layer + self.n_experts * self.expert_params
        router = self.d_model * self.n_experts if self.n_experts > 1 else 0
        return self.n_layers * (per_layer + router) + self.embedding_params + self.lm_head_params

    @property
    def active_params(self) -> int:
        """Parameters multiplied per token (the FLOP count is 2x this): the routed experts only, no embedding
        lookup (a gather, not a matmul) but the LM head (a full matmul; with tied embeddings it is the same
        matrix)."""
        per_layer = self.attn_params_per_layer + self.experts_per_token * self.expert_params
        return self.n_layers * per_layer + self.vocab * self.d_model

    @property
    def kv_vector_width(self) -> int:
        """Values in one token's K (or V) vector of one layer: the Oaken per-token quantization unit."""
        return self.n_kv_heads * self.head_dim

    @property
    def kv_values_per_token(self) -> int:
        """K and V values one token adds to the cache over all layers."""
        return 2 * self.n_layers * self.kv_vector_width


def _m(**kw) -> ModelShape:
    return ModelShape(**kw)


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        _m(
            name="llama2-7b",
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=32,
            head_dim=128,
            d_ffn=11008,
            vocab=32000,
        ),
        _m(
            name="llama2-13b",
            n_layers=40,
            d_model=5120,
            n_heads=40,
            n_kv_heads=40,
            head_dim=128,
            d_ffn=13824,
            vocab=32000,
        ),
        _m(
            name="llama2-70b",
            n_layers=80,
            d_model=8192,
            n_heads=64,
            n_kv_heads=8,
            head_dim=128,
            d_ffn=28672,
            vocab=32000,
        ),
        _m(
            name="opt-6.7b",
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=32,
            head_dim=128,
            d_ffn=16384,
            vocab=50272,
            ffn="mlp",
            tied_embeddings=True,
            max_position=2048,
        ),
        _m(
            name="opt-13b",
            n_layers=40,
            d_model=5120,
            n_heads=40,
            n_kv_heads=40,
            head_dim=128,
            d_ffn=20480,
            vocab=50272,
            ffn="mlp",
            tied_embeddings=True,
            max_position=2048,
        ),
        _m(
            name="opt-30b",
            n_layers=48,
            d_model=7168,
            n_heads=56,
            n_kv_heads=56,
            head_dim=128,
            d_ffn=28672,
            vocab=50272,
            ffn="mlp",
            tied_embeddings=True,
            max_position=2048,
        ),
        _m(
            name="mistral-7b",
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            head_dim=128,
            d_ffn=14336,
            vocab=32000,
            sliding_window=4096,
            max_position=32768,
        ),
        _m(
            name="mixtral-8x7b",
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            head_dim=128,
            d_ffn=14336,
            vocab=32000,
            n_experts=8,
            experts_per_token=2,
            max_position=32768,
        ),
        _m(
            name="llama3-8b",
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            head_dim=128,
            d_ffn=14336,
            vocab=128256,
            max_position=8192,
        ),
        _m(
            name="qwen2.5-7b",
            n_layers=28,
            d_model=3584,
            n_heads=28,
            n_kv_heads=4,
            head_dim=128,
            d_ffn=18944,
            vocab=152064,
            max_position=32768,
        ),
    )
}

#: The models of the paper's Figure 11 / headline average (the current models are extra).
PAPER_MODELS = (
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "opt-6.7b",
    "opt-13b",
    "opt-30b",
    "mistral-7b",
    "mixtral-8x7b",
)


def get_model(name: str) -> ModelShape:
    """Return the model called ``name`` (case-insensitive; '-' and '_' interchangeable)."""
    key = name.strip().lower().replace("_", "-")
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[key]
