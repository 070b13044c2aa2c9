"""Recording what the attention layers receive (src/oakenkv/calibrate/recording.py).

What must hold: the layer-by-layer recording (``stream_attention``) gives exactly the tensors the all-at-once
recording (``record_attention``, one whole forward pass per window) gives, bit for bit, on Llama-style models
and on a model with sliding-window layers; it runs one layer at a time (a layer is recorded only when asked for);
it leaves the model as it found it; and a model whose forward cannot be run layer by layer is refused up front.
"""

from __future__ import annotations

import pytest
import torch

from oakenkv.calibrate.recording import StreamingUnsupported, decoder_layers, record_attention, stream_attention


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attention_bias=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _tiny_gemma3():
    """Sliding-window layers (window 8) beside full ones, a q/k norm, and RoPE tables per layer type."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    return Gemma3ForCausalLM(cfg).eval()


def _windows(runs: int, tokens: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (runs, tokens), generator=torch.Generator().manual_seed(1))


def _assert_same(model, windows, query_runs):
    ref = record_attention(model, windows, query_runs)
    seen = []
    for layer in stream_attention(model, windows, query_runs):
        want = ref.layer(layer.index)
        for name in ("queries", "keys", "values"):
            a, b = getattr(layer, name), getattr(want, name)
            assert a.dtype == b.dtype == torch.float32 and a.device.type == "cpu"
            assert a.shape == b.shape and torch.equal(a, b), (layer.index, name)
        assert (layer.scaling, layer.sliding_window) == (want.scaling, want.sliding_window)
        assert (layer.key_scale_shared_by_heads, layer.value_norm) == (want.key_scale_shared_by_heads, want.value_norm)
        seen.append(layer.index)
    assert seen == list(range(ref.num_layers))
    return ref


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gemma3])
def test_the_stream_records_what_a_whole_forward_pass_records(make):
    model = make()
    ref = _assert_same(model, _windows(3, 40), query_runs=2)
    assert ref.queries[0].shape[0] == 2 and ref.keys[0].shape[0] == 3
    if make is _tiny_gemma3:
        assert ref.sliding_window[0] == 8 and ref.sliding_window[1] is None and ref.key_scale_shared_by_heads


def test_the_stream_on_the_default_model(default_model):
    from oakenkv.calibrate.spec import CalibrationSpec, calibration_windows

    w = calibration_windows(default_model.tokenizer, CalibrationSpec(samples=2, window=48))
    _assert_same(default_model.model, w, query_runs=1)


def test_the_stream_runs_one_layer_at_a_time_and_restores_the_model():
    model = _tiny_llama()
    ids = _windows(2, 24)
    with torch.no_grad():
        before = model(ids[:1]).logits
    steps = []
    stream = stream_attention(model, ids, 1, steps.append)
    assert steps == []  # the stand-in pass runs no decoder layer
    first = next(stream)
    assert first.index == 0 and len(steps) == 2  # one step per window of layer 0, nothing of layer 1 yet
    rest = list(stream)
    assert [r.index for r in rest] == [1, 2] and len(steps) == 6
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))
    assert model.config._attn_implementation != "oakenkv_record"
    with torch.no_grad():
        assert torch.equal(model(ids[:1]).logits, before)


def test_a_model_that_cannot_run_layer_by_layer_is_refused_before_any_layer_runs():
    model = _tiny_llama()
    layers = model.model.layers
    real = type(model.model).forward

    def skips_a_layer(self, *args, **kwargs):  # a forward that calls its layers out of order
        self.layers = torch.nn.ModuleList([layers[0], layers[2], layers[1]])
        try:
            return real(self, *args, **kwargs)
        finally:
            self.layers = layers

    model.model.forward = skips_a_layer.__get__(model.model)
    with pytest.raises(StreamingUnsupported, match="order"):
        stream_attention(model, _windows(1, 8), 1)
    assert all("forward" not in layer.__dict__ for layer in layers)


def test_a_model_that_does_more_between_its_layers_is_refused():
    """A forward that changes the hidden states between two decoder layers is not what running the layers one
    at a time computes: the check against a whole forward pass on a few tokens refuses it."""
    model = _tiny_llama()
    layers = model.model.layers
    real = type(model.model).forward

    class Scaled(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.inner = layer

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs) * 1.5

    def scales_between_layers(self, *args, **kwargs):
        self.layers = torch.nn.ModuleList([Scaled(layer) for layer in layers])
        try:
            return real(self, *args, **kwargs)
        finally:
            self.layers = layers

    model.model.forward = scales_between_layers.__get__(model.model)
    with pytest.raises(StreamingUnsupported, match="does not reproduce its forward pass"):
        stream_attention(model, _windows(2, 40), 1)
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert model.config._attn_implementation != "oakenkv_record"
