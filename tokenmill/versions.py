"""Installed library versions: part of every cache key whose figures or files a library upgrade may change
(engine trials, gate verdicts, exported and quantized models). A leaf: it imports nothing of tokenmill."""

from __future__ import annotations

from importlib import metadata


def library_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """The installed versions of these distributions (None: not installed)."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found
