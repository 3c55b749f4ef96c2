"""Corpora nobody tuned for, built at bench time from files every Python install has.

The sample corpus was written with the pipeline in mind; these are not. They are CPython's
own standard library docstrings (the installed `Lib/`), read in a fixed order, so the same
interpreter version gives the same corpus on any machine:

- short: one-line summaries, 10 to 60 tokens each (what a search index of API names holds);
- long: whole docstrings and their neighbours joined to ~1,100 characters, near the 256-token
  limit of all-MiniLM-L6-v2 (what a RAG chunker produces);
- mixed: every docstring as written, from one word to pages (truncated at the model's limit).

A row is `id` (file:line), `text`.

One held-out shape, for checking a figure on text none of the above resembles:

- readme: the paragraphs of the installed packages' own descriptions (their METADATA's body: README
  prose, install commands, code, tables), in package order, from a few words to pages.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SHAPES = ("short", "long", "mixed")
HELD_OUT_SHAPES = ("readme",)


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(id, docstring) for every module, class and function docstring of the stdlib, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, str]] = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and doc.strip():
                    line = getattr(node, "lineno", 0)
                    found.append((f"{path.relative_to(root)}:{line}", doc.strip()))
    return found


def package_paragraphs() -> list[tuple[str, str]]:
    """(id, paragraph) for every paragraph of at least 5 words in the installed distributions' METADATA bodies."""
    from importlib import metadata

    found: list[tuple[str, str]] = []
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        body = (dist.read_text("METADATA") or "").split("\n\n", 1)
        for i, paragraph in enumerate(body[1].split("\n\n") if len(body) > 1 else []):
            text = " ".join(paragraph.split())
            if len(text.split()) >= 5:
                found.append((f"{dist.metadata['Name']}:{i}", text))
    return found


def build(shape: str, rows: int) -> pa.Table:
    docs = package_paragraphs() if shape == "readme" else stdlib_docstrings()
    if shape == "short":
        picked = []
        for key, doc in docs:
            first = " ".join(doc.split("\n\n")[0].split())
            if 8 <= len(first.split()) <= 40:  # ~10 to 60 word pieces
                picked.append((key, first))
    elif shape == "long":
        picked, text, key = [], "", None
        for doc_key, doc in docs:
            key = key or doc_key
            text = f"{text}\n\n{doc}" if text else doc
            if len(text) >= 1100:
                picked.append((key, text[:1200]))
                text, key = "", None
    elif shape in ("mixed", "readme"):
        picked = docs
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES + HELD_OUT_SHAPES)}")
    if len(picked) < rows:  # a small stdlib: cycle, with ids kept unique
        picked = [(f"{k}#{i // len(picked)}", t) for i, (k, t) in enumerate(picked * (rows // len(picked) + 1))]
    picked = picked[:rows]
    return pa.table({"id": [k for k, _ in picked], "text": [t for _, t in picked]})


def write(shape: str, rows: int, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{shape}.parquet"
    pq.write_table(build(shape, rows), path, row_group_size=1000)
    return path
