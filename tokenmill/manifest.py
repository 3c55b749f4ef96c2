"""_manifest.json: every shard of the job with its fingerprint, rows and tokens."""

from __future__ import annotations

import datetime as dt
from typing import Any, Iterable

from tokenmill.results import OUTPUT_FORMAT_VERSION, ShardResult
from tokenmill.spec import JobSpec


def build_manifest(spec: JobSpec, results: Iterable[ShardResult], shards_total: int,
                   final: bool = True) -> dict[str, Any]:
    """final=False while the job runs: the counts so far, never marked complete."""
    results = sorted(results, key=lambda r: r.shard_id)
    totals = {key: sum(getattr(r, key) for r in results)
              for key in ("rows_in", "rows_out", "rows_rejected", "rows_truncated", "input_tokens", "output_tokens")}
    if spec.mode == "generate" and spec.generation.response_format is not None:
        totals["structured_invalid_rows"] = sum(r.structured_invalid_rows for r in results)
    return {
        "format_version": OUTPUT_FORMAT_VERSION,
        "updated_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "mode": spec.mode,
        "model": spec.model_name,
        "input": spec.input,
        "complete": final and len(results) == shards_total,
        "shards_total": shards_total,
        "shards_done": len(results),
        "totals": totals,
        "shards": [
            {
                "shard_id": r.shard_id,
                "fingerprint": r.fingerprint,
                "uri": r.uri,
                "output": r.output,
                "rows_in": r.rows_in,
                "rows_out": r.rows_out,
                "rows_rejected": r.rows_rejected,
                "rows_truncated": r.rows_truncated,
                "input_tokens": r.input_tokens,
                "output_tokens": r.output_tokens,
                **({"structured_invalid_rows": r.structured_invalid_rows}
                   if spec.mode == "generate" and spec.generation.response_format is not None else {}),
            }
            for r in results
        ],
    }
