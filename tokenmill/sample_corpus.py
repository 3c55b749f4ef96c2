"""A realistic sample corpus from text already on the machine.

The long descriptions in installed Python packages' metadata are real English prose
(READMEs) written by many authors. Paragraphs are joined into documents whose
lengths follow a log-normal law, as real corpora do: many short documents and a
long tail, some far beyond a model's input limit.
"""

from __future__ import annotations

import random
import re
from importlib import metadata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODE_FENCE = re.compile(r"```.*?```|~~~.*?~~~", re.S)
_MARKUP = re.compile(r"<[^>]+>|!\[[^\]]*\]\([^)]*\)|\[([^\]]*)\]\([^)]*\)|[#*`>|]+|={3,}|-{3,}|\.\. \w+::.*")


def english_paragraphs() -> list[tuple[str, str]]:
    """(package, paragraph) pairs of prose from installed packages' descriptions."""
    found: list[tuple[str, str]] = []
    seen: set[str] = set()
    dists = sorted(metadata.distributions(), key=lambda d: (d.metadata.get("Name") or "").lower())
    for dist in dists:
        name = dist.metadata.get("Name") or "unknown"
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        body = _CODE_FENCE.sub(" ", str(body))
        for block in re.split(r"\n\s*\n", body):
            text = " ".join(_MARKUP.sub(lambda m: m.group(1) or " ", block).split())
            if _is_prose(text) and text not in seen:
                seen.add(text)
                found.append((name, text))
    return found


def _is_prose(text: str) -> bool:
    words = text.split()
    if len(words) < 6:
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    return letters / len(text) > 0.85 and any(w.lower() in {"the", "a", "is", "to", "of", "and"} for w in words)


def write_sample_corpus(
    directory: str | Path,
    *,
    documents: int = 20_000,
    files: int = 4,
    row_group_size: int = 1_000,
    seed: int = 0,
) -> list[Path]:
    paragraphs = english_paragraphs()
    if len(paragraphs) < 50:
        raise RuntimeError(f"only {len(paragraphs)} paragraphs of prose found in installed packages")
    # Sentences in reading order, each marked with whether it starts a paragraph.
    sentences: list[tuple[str, str, bool]] = []
    for package, paragraph in paragraphs:
        for k, sentence in enumerate(_SENTENCE_END.split(paragraph)):
            sentences.append((package, sentence, k == 0))
    rng = random.Random(seed)
    ids, texts, sources = [], [], []
    seen: set[str] = set()
    while len(ids) < documents:
        # a window of consecutive sentences: median ~2, mean ~4, a tail of very long ones
        count = max(1, int(rng.lognormvariate(0.7, 1.2)))
        first = rng.randrange(len(sentences))
        window = [sentences[(first + k) % len(sentences)] for k in range(min(count, len(sentences)))]
        text = "".join(("\n\n" if starts and i else " " if i else "") + sentence
                       for i, (_, sentence, starts) in enumerate(window))
        if text in seen and len(seen) < len(sentences):
            continue
        seen.add(text)
        ids.append(f"doc-{len(ids):06d}")
        texts.append(text)
        sources.append(window[0][0])
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    per_file = -(-documents // files)
    written = []
    for index in range(files):
        part = slice(index * per_file, min((index + 1) * per_file, documents))
        table = pa.table({"id": ids[part], "text": texts[part], "source": sources[part]})
        path = out / f"part-{index:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")
        written.append(path)
    return written
