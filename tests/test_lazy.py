"""oakenkv.assets.lazy: a model whose embeddings, LM head and decoder layers stay on disk until called."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from oakenkv.assets.lazy import SafetensorsFile, execution_device, lazy_weights, load_lazy


@pytest.fixture(scope="module")
def lazy_model(default_model):
    return load_lazy(default_model.source)


def _resident_units(lazy) -> list[str]:
    return [name for name, unit in lazy.units if any(p.device.type != "meta" for p in unit.parameters())]


def test_logits_and_digest_equal_the_eagerly_loaded_models(default_model, lazy_model):
    from oakenkv.calibrate.identity import weights_digest

    lazy = lazy_weights(lazy_model)
    ids = torch.tensor([[1, 504, 3458, 282, 260, 1345, 30, 2]])
    before = lazy.reads
    with torch.inference_mode():
        want = default_model.model(ids).logits
        got = lazy_model(ids).logits
    assert torch.equal(got, want)
    # one read per unit of a whole forward pass (embeddings, 30 layers, the tied LM head), one unit left in memory
    assert lazy.reads - before == 32
    assert len(_resident_units(lazy)) == 1
    assert weights_digest(lazy_model) == weights_digest(default_model.model)
    assert execution_device(lazy_model) == torch.device("cpu")


def test_the_streamed_recording_is_the_eager_models_and_stand_ins_read_nothing(default_model, lazy_model):
    from oakenkv.calibrate.recording import stream_attention

    ids = torch.randint(0, 40000, (2, 48), generator=torch.Generator().manual_seed(3))
    lazy = lazy_weights(lazy_model)
    want = list(stream_attention(default_model.model, ids, 1))
    before = lazy.reads
    got = list(stream_attention(lazy_model, ids, 1))
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("queries", "keys", "values")), a.index
    # the check's whole forward pass (32 units) and the check's and the windows' layers (30 each); the stand-in
    # passes read the embeddings only (once: they stay in memory while the stand-ins run)
    assert lazy.reads - before <= 32 + 30 + 30 + 2


def test_a_bfloat16_lazy_model_holds_the_eager_numbers(default_model):
    from oakenkv.assets.models import load_model
    from oakenkv.calibrate.identity import weights_digest

    eager = load_model("default", dtype=torch.bfloat16).model
    lazy = load_lazy(default_model.source, torch.bfloat16)
    assert weights_digest(lazy) == weights_digest(eager)


def test_load_model_lazy_refuses_a_hub_id():
    from oakenkv.assets.models import load_model

    with pytest.raises(ValueError, match="hub id"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct", lazy=True)


def _write(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_safetensors_reader_reads_what_safetensors_wrote(tmp_path):
    from safetensors.torch import save_file

    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(4).to(torch.bfloat16),
        "d": torch.empty(0, 3),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    for name, t in tensors.items():
        got = f.read(name)
        assert got.dtype == t.dtype and torch.equal(got, t)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "does not fit"),
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "does not fit"),
        ({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, "unsupported dtype"),
        ({"x": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "no valid shape and offsets"),
        ({"x": {"dtype": "F32", "shape": "two", "data_offsets": [0, 8]}}, b"\0" * 8, "no valid shape and offsets"),
        ({"x": [1, 2]}, b"", "unsupported dtype"),
    ],
)
def test_corrupt_safetensors_files_are_refused_with_their_path(tmp_path, header, data, message):
    path = tmp_path / "bad.safetensors"
    _write(path, header, data)
    with pytest.raises(ValueError, match=message) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value)


def test_unreadable_headers_are_refused(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\1\2")
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsFile(short)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ValueError, match="unreadable safetensors header"):
        SafetensorsFile(garbage)
    a_list = tmp_path / "list.safetensors"
    a_list.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(ValueError, match="not a JSON object"):
        SafetensorsFile(a_list)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 10**12))
    with pytest.raises(ValueError, match="corrupt"):
        SafetensorsFile(huge)


def test_a_directory_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        load_lazy(tmp_path)
