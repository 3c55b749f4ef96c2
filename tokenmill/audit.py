"""Ids unique across shards: the first shard that has an id keeps it, later ones reject it.

Each shard rejects ids repeated inside itself as it runs; an id repeated in another
shard (another file, another row group) is only visible once every shard is done,
so this pass runs after them. Each later copy leaves that shard's output and goes to
`_rejects/<shard_id>.duplicates.parquet` with its file, row and reason.

The pass is idempotent and crash-safe: it reads back what an earlier pass moved, writes
the rejects before it rewrites the output, and re-running it changes nothing. It holds
every id of the job in memory once (as Arrow strings plus two integers a row): about
40 bytes a row, so 100 million rows need some 4 GB.
"""

from __future__ import annotations

import logging
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill.errors import TokenmillError
from tokenmill.outputs import OutputStore, rejects_table
from tokenmill.results import ShardResult
from tokenmill.shards import ROW_NUMBER, ShardSpec, read_shard
from tokenmill.spec import JobSpec
from tokenmill.storage import retry_io

log = logging.getLogger(__name__)


def reject_cross_shard_duplicates(spec: JobSpec, shards: Sequence[ShardSpec],
                                  results: Sequence[ShardResult]) -> list[ShardResult]:
    """The results with each shard's row counts after duplicates moved to rejects."""
    if len(results) < 2:
        return list(results)
    store = OutputStore(spec.output, spec.storage_options)
    ordered = sorted(results, key=lambda r: r.shard_id)
    by_id = {s.shard_id: s for s in shards}

    outputs, moved = [], []
    for result in ordered:
        outputs.append(_ids(store, result.output))
        path = store.shard_duplicates(result.shard_id)
        moved.append(_ids(store, path) if store.exists(path) else pa.array([], pa.string()))

    owners = _first_owner(outputs, moved)
    adjusted = []
    for index, result in enumerate(ordered):
        mine = pa.concat_arrays([outputs[index], moved[index]]).unique()
        first = pc.index_in(mine, value_set=owners.column("id"))
        owner_index = pc.take(owners.column("owner"), first)
        duplicates = pc.filter(mine, pc.less(owner_index, index))
        duplicate_set = set(duplicates.to_pylist())
        already = set(moved[index].to_pylist())
        if already - duplicate_set:
            raise TokenmillError(
                f"shard {result.shard_id}: rows once moved to rejects as duplicates now own their id, because "
                f"an earlier shard changed; delete {store.shard_duplicates(result.shard_id)} and that shard's "
                f"record under _state/ and run again")
        if duplicate_set != already:
            _move_to_rejects(store, spec, by_id[result.shard_id], result, duplicate_set, owners, ordered)
        if duplicate_set:
            adjusted.append(result.model_copy(update={
                "rows_out": result.rows_out - len(duplicate_set),
                "rows_rejected": result.rows_rejected + len(duplicate_set),
            }))
        else:
            adjusted.append(result)
    return adjusted


def _ids(store: OutputStore, path: str) -> pa.Array:
    table = retry_io(lambda: pq.read_table(path, columns=["id"], filesystem=store.fs), f"reading ids of {path}")
    return pc.cast(table.column("id"), pa.string()).combine_chunks()


def _first_owner(outputs: list[pa.Array], moved: list[pa.Array]) -> pa.Table:
    """id -> index of the first shard holding it, for ids held by more than one shard."""
    pieces = [pa.table({"id": pa.concat_arrays([out, gone]),
                        "shard": pa.array([index] * (len(out) + len(gone)), pa.int32())})
              for index, (out, gone) in enumerate(zip(outputs, moved))]
    grouped = pa.concat_tables(pieces).group_by("id").aggregate([("shard", "min"), ("shard", "count_distinct")])
    shared = grouped.filter(pc.greater(grouped.column("shard_count_distinct"), 1))
    return pa.table({"id": shared.column("id"), "owner": shared.column("shard_min")})


def _move_to_rejects(store: OutputStore, spec: JobSpec, shard: ShardSpec, result: ShardResult,
                     duplicates: set[str], owners: pa.Table, ordered: Sequence[ShardResult]) -> None:
    owner_of = dict(zip(owners.column("id").to_pylist(), owners.column("owner").to_pylist()))
    source, _ = read_shard(shard, [spec.id_column], spec.storage_options)
    source_ids = pc.cast(source.column(spec.id_column), pa.string()).to_pylist()
    rows_of = {}
    for ident, row in zip(source_ids, source.column(ROW_NUMBER).to_pylist()):
        if ident in duplicates and ident not in rows_of:
            rows_of[ident] = row
    rejects = []
    for ident in sorted(duplicates, key=lambda i: rows_of.get(i, -1)):
        keeper = ordered[owner_of[ident]]
        rejects.append((rows_of.get(ident), ident,
                        f"duplicate id: shard {keeper.shard_id} of {keeper.uri} has it too and keeps it"))
    # rejects first: a crash between the two writes leaves the row in both, which the next pass settles
    store.write_table(store.shard_duplicates(result.shard_id),
                      rejects_table(result.shard_id, shard.uri, rejects, shard.format != "parquet"))
    output = store.read_table(result.output)
    keep = pc.invert(pc.is_in(pc.cast(output.column("id"), pa.string()), value_set=pa.array(sorted(duplicates))))
    store.write_table(result.output, output.filter(keep))
    log.warning("shard %s: %d rows whose id an earlier shard has moved to rejects", result.shard_id, len(duplicates))
