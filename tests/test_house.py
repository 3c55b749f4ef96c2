"""House rules the code keeps: no function in tokenmill/ over 60 lines, and no block of six or more
lines standing twice inside tokenmill/, tasks/ or flows/.

bench/ is left out of the duplicate check: it is being rewritten onto one harness (issue 28 item 6)
and still repeats itself today."""
from __future__ import annotations

import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 60
MIN_BLOCK_LINES = 6
DUPLICATE_ROOTS = ("tokenmill", "tasks", "flows")


def long_functions(path: Path) -> list[str]:
    """Each function in `path` longer than MAX_FUNCTION_LINES, from its `def` line to its last line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_tokenmill_is_over_60_lines():
    found = [f for path in sorted((ROOT / "tokenmill").glob("*.py")) for f in long_functions(path)]
    assert not found, "functions over 60 lines (split them into named steps):\n" + "\n".join(found)


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _import_lines(tree: ast.AST) -> set[int]:
    return {n for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for n in range(node.lineno, node.end_lineno + 1)}


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text with white space folded) for each line that is code: not blank, not a
    comment, not a docstring, not an import, not lone punctuation."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    skip = _docstring_lines(tree) | _import_lines(tree)
    comments = {tok.start[0]: tok.start[1] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    out = []
    for number, line in enumerate(source.splitlines(), start=1):
        if number in skip:
            continue
        if number in comments:
            line = line[:comments[number]]
        text = " ".join(line.split())
        if text and any(ch.isalnum() for ch in text):
            out.append((number, text))
    return out


def duplicate_blocks(paths: list[Path]) -> list[str]:
    """Each run of MIN_BLOCK_LINES code lines that stands in two places (same file or two files)."""
    where: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for path in paths:
        lines = code_lines(path)
        for i in range(len(lines) - MIN_BLOCK_LINES + 1):
            window = lines[i:i + MIN_BLOCK_LINES]
            where[tuple(t for _, t in window)].append(
                f"{path.relative_to(ROOT)}:{window[0][0]}-{window[-1][0]}")
    return [" ~ ".join(places) for places in where.values() if len(places) > 1]


def test_no_block_of_six_lines_stands_twice():
    paths = sorted(p for root in DUPLICATE_ROOTS for p in (ROOT / root).glob("*.py"))
    found = duplicate_blocks(paths)
    assert not found, "blocks of 6+ lines standing twice (share one function):\n" + "\n".join(found)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The two checks fail on a long function and a repeated block (so they can fail at all)."""
    body = "\n".join(f"    x{i} = {i} + y" for i in range(61))
    long = tmp_path / "long.py"
    long.write_text(f"def f(y):\n{body}\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert long_functions(long) == ["long.py:1 f (62 lines)"]
        block = "\n".join(f"    a{i} = call(b, {i})  # note" for i in range(6))
        twice = tmp_path / "twice.py"
        twice.write_text(f"def g(b):\n{block}\n\n\ndef h(b):\n    '''doc'''\n{block}\n")
        assert duplicate_blocks([twice]) == ["twice.py:2-7 ~ twice.py:12-17"]
    finally:
        ROOT = saved
