"""Source of ``data/long_texts.jsonl``: long real English texts for the long-context eviction study (issue 36,
``python -m kvlab evict-long``; :mod:`kvlab.studies.eviction.long_texts`). Each line is one document
``{"id", "text", "sources"}`` of at least ``MIN_TOKENS`` tokens of the embedded SmolLM2 tokenizer (checked by
tests/test_evict_long.py): enough for an 8,192-position context plus its continuation.

How the documents are made (deterministic): the SOURCES below are read in their listed order, HTML tags
stripped (idlelib's help page), each source's text normalized (runs of blank lines -> one blank line, trailing
spaces dropped), and all of them concatenated with a blank line between sources into one corpus. The corpus is
then cut at paragraph boundaries (blank lines) into consecutive pieces of at least ``MIN_TOKENS`` tokens (each piece
grows one paragraph at a time until it holds that many; the tail shorter than that is dropped). A document can therefore span the end of one source and the start
of the next; its ``sources`` field names them. Documents do not overlap each other.

Where each text comes from (all on this machine, none fetched) and its license:

* CPython 3.11.7's ``Lib/pydoc_data/topics.py`` (the ``help()`` topics: the language reference and library
  documentation as plain text) and ``Lib/idlelib/{help.html, NEWS.txt, NEWS2x.txt, README.txt, HISTORY.txt,
  TODO.txt}``: Python Software Foundation License Version 2 (permissive; copying with the PSF copyright notice).
  Copyright (c) 2001-2023 Python Software Foundation.
* ``/usr/share/common-licenses/{GPL-3, GFDL-1.3, LGPL-2.1, MPL-2.0, Apache-2.0, GPL-2, LGPL-2, GFDL-1.2, MPL-1.1}`` (Debian's base-files): the
  license texts themselves, which their stewards (FSF, Mozilla, the ASF) allow to be copied verbatim.
* The README / long descriptions (with changelogs) in the ``METADATA`` of the wheels ``tqdm`` (MPL-2.0 and MIT),
  ``pydantic`` (MIT), ``fonttools`` (MIT), ``matplotlib`` (PSF-based Matplotlib license) and ``charset-normalizer``
  (MIT) in kvlab's environment.

None of these texts occurs in ``data/prompts.jsonl``, ``data/train_prompts.jsonl`` or ``data/calibration.jsonl``
(tests/test_evict_long.py checks that no 12-word run of a document appears there).

Run ``python data/long_texts_source.py`` (with the environment that has the wheels named above) to rewrite the
JSON Lines file; it prints the documents' character counts.
"""
from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

MIN_TOKENS = 8_320         # per document: an 8,192-position context and its continuation, with room to spare
STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")


def _pydoc_topics() -> str:
    sys.path.insert(0, str(STDLIB))
    try:
        from pydoc_data.topics import topics
    finally:
        sys.path.pop(0)
    return "\n\n".join(topics[k] for k in sorted(topics))


def _file(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _html(path: Path) -> str:
    text = re.sub(r"(?s)<(script|style).*?</\1>", "", _file(path))
    text = re.sub(r"(?s)<[^>]+>", "", text)
    return html.unescape(text)


def _metadata(dist: str) -> str:
    from importlib.metadata import distribution

    text = distribution(dist).read_text("METADATA") or ""
    return text.split("\n\n", 1)[1] if "\n\n" in text else text        # the description, headers dropped


SOURCES = [
    ("cpython-3.11.7:Lib/pydoc_data/topics.py", _pydoc_topics),
    ("cpython-3.11.7:Lib/idlelib/help.html", lambda: _html(STDLIB / "idlelib" / "help.html")),
    ("cpython-3.11.7:Lib/idlelib/NEWS.txt", lambda: _file(STDLIB / "idlelib" / "NEWS.txt")),
    ("cpython-3.11.7:Lib/idlelib/NEWS2x.txt", lambda: _file(STDLIB / "idlelib" / "NEWS2x.txt")),
    ("cpython-3.11.7:Lib/idlelib/README.txt", lambda: _file(STDLIB / "idlelib" / "README.txt")),
    ("cpython-3.11.7:Lib/idlelib/HISTORY.txt", lambda: _file(STDLIB / "idlelib" / "HISTORY.txt")),
    ("cpython-3.11.7:Lib/idlelib/TODO.txt", lambda: _file(STDLIB / "idlelib" / "TODO.txt")),
    *[(f"debian:/usr/share/common-licenses/{n}", (lambda n=n: _file(Path("/usr/share/common-licenses") / n)))
      for n in ("GPL-3", "GFDL-1.3", "LGPL-2.1", "MPL-2.0", "Apache-2.0", "GPL-2", "LGPL-2", "GFDL-1.2", "MPL-1.1")],
    ("pypi:tqdm METADATA", lambda: _metadata("tqdm")),
    ("pypi:pydantic METADATA", lambda: _metadata("pydantic")),
    ("pypi:fonttools METADATA", lambda: _metadata("fonttools")),
    ("pypi:matplotlib METADATA", lambda: _metadata("matplotlib")),
    ("pypi:charset-normalizer METADATA", lambda: _metadata("charset-normalizer")),
]


def _normalize(text: str) -> str:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _count_tokens():
    """Token counter of the embedded teacher's tokenizer (offline)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from transformers import AutoTokenizer

    from kvlab.core.models import teacher_path

    tok = AutoTokenizer.from_pretrained(teacher_path(), local_files_only=True)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def long_texts(count_tokens=None) -> list[dict]:
    """The documents (module docstring)."""
    count = count_tokens or _count_tokens()
    paras: list[tuple[str, str]] = []
    for name, read in SOURCES:
        paras += [(name, p) for p in _normalize(read()).split("\n\n") if p.strip()]
    docs, cur, names, est = [], [], [], 0
    for name, p in paras:
        cur.append(p)
        est += count(p) + 1                      # paragraphs counted alone: a close lower bound of the whole
        if name not in names:
            names.append(name)
        if est >= MIN_TOKENS - 64 and count("\n\n".join(cur)) >= MIN_TOKENS:
            docs.append({"id": f"long-{len(docs):03d}", "text": "\n\n".join(cur), "sources": list(names)})
            cur, names, est = [], [], 0
    return docs


def render() -> str:
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in long_texts())


if __name__ == "__main__":
    out = Path(__file__).with_name("long_texts.jsonl")
    text = render()
    out.write_text(text, encoding="utf-8")
    for line in text.splitlines():
        d = json.loads(line)
        print(d["id"], len(d["text"]), d["sources"])
