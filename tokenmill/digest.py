"""One stable digest for every identity tokenmill names things by (shard fingerprints, cache
keys, shard lists, job keys): the same value gives the same hex on any machine and run."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def stable_digest(value: Any, length: int | None = None) -> str:
    """sha256 hex of a JSON value (keys sorted) or a string, cut to `length` characters."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:length]
