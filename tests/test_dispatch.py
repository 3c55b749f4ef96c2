"""The fleet's decisions, without a fleet: balance, re-dispatch, speculative copies, records.

The real fleet (a Prefect server, work pools, workers, a SIGKILL) is in test_fleet.py.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from conftest import write_parquet
from tokenmill.dispatch import (
    DispatchLedger,
    balance_by_tokens,
    fleet_metrics,
    read_shard_list,
    select_shards,
    worker_rows,
    worker_summary_metrics,
    write_shard_list,
)
from tokenmill.errors import ConfigError
from tokenmill.outputs import OutputStore
from tokenmill.results import ShardResult
from tokenmill.shards import _finish, discover_shards


def test_balance_puts_the_longest_shard_first_onto_the_least_loaded_worker():
    weights = {"a": 7, "b": 5, "c": 4, "d": 3, "e": 1}
    lists = balance_by_tokens(weights, 2)
    # a -> w0 (7); b -> w1 (5); c -> w1 (9); d -> w0 (10); e -> w1 (10)
    assert lists == [["a", "d"], ["b", "c", "e"]]
    assert sorted(s for work in lists for s in work) == sorted(weights)
    loads = [sum(weights[s] for s in work) for work in lists]
    assert max(loads) - min(loads) <= max(weights.values())


def test_balance_within_lpt_bound_on_a_skewed_corpus():
    weights = {f"s{i}": float(1000 if i % 10 == 0 else 10 + i) for i in range(200)}
    lists = balance_by_tokens(weights, 7)
    loads = [sum(weights[s] for s in work) for work in lists]
    best_possible = max(sum(weights.values()) / 7, max(weights.values()))
    assert max(loads) <= 4 / 3 * best_possible
    assert len({s for work in lists for s in work}) == 200


def test_balance_drops_empty_lists_and_rejects_no_workers():
    assert balance_by_tokens({"a": 1.0, "b": 2.0}, 5) == [["b"], ["a"]]
    with pytest.raises(ValueError):
        balance_by_tokens({"a": 1.0}, 0)


def _ledger(**kwargs) -> DispatchLedger:
    weights = {f"s{i}": 10.0 for i in range(6)}
    return DispatchLedger(weights, workers=2, **kwargs)


def _launch_all(ledger: DispatchLedger, now: float = 0.0) -> list[str]:
    ids = []
    for index, item in enumerate(ledger.first_launches()):
        ledger.launched(item, f"run{index}", f"w{index}", now)
        ids.append(f"run{index}")
    return ids


def test_a_crashed_run_has_only_its_unfinished_shards_launched_again_in_the_next_round():
    ledger = _ledger()
    first, second = _launch_all(ledger)
    held = ledger.runs[first].shard_ids
    ledger.seen_running(first, 1.0)
    ledger.mark_finished(held[:1])  # it persisted one shard before the node went away
    again = ledger.run_ended(first, "CRASHED", 5.0, "exited with -9")
    assert len(again) == 1 and again[0].shard_ids == held[1:] and again[0].round == 2
    assert again[0].replaces == first and not again[0].speculative
    ledger.launched(again[0], "run2", "w2", 6.0)
    ledger.mark_finished(ledger.runs[second].shard_ids)
    assert ledger.run_ended(second, "COMPLETED", 7.0) == []
    ledger.mark_finished(held[1:])
    assert ledger.run_ended("run2", "COMPLETED", 9.0) == []
    assert ledger.done and ledger.rounds == 2 and ledger.speculative_copies == 0


def test_rounds_are_bounded_and_what_is_left_is_reported():
    ledger = _ledger(max_rounds=2)
    first, _ = _launch_all(ledger)
    again = ledger.run_ended(first, "FAILED", 1.0, "CUDA error")
    ledger.launched(again[0], "run2", "w2", 1.0)
    assert ledger.run_ended("run2", "CANCELLED", 2.0) == []  # round 2 of 2: no third launch
    assert ledger.given_up == set(again[0].shard_ids)
    assert set(ledger.missing()) >= ledger.given_up and not ledger.done


def test_a_shard_a_live_copy_still_holds_is_not_launched_a_third_time():
    ledger = _ledger(straggler_seconds=10.0)
    first, second = _launch_all(ledger)
    ledger.seen_working(first, 0.0)
    ledger.seen_running(second, 0.0)  # running, but still waiting for a GPU slot: queued, not late
    [straggler] = ledger.stragglers(11.0)
    copy = ledger.speculative_copy(straggler)
    assert copy.speculative and copy.round == 1 and copy.shard_ids == list(reversed(straggler.shard_ids))
    ledger.launched(copy, "copy", "w0-copy", 11.0)
    assert ledger.speculative_copy(straggler) is None  # one copy per shard
    assert ledger.run_ended(first, "CRASHED", 12.0) == []  # the copy covers every shard it had


def test_straggler_deadline_follows_the_finished_runs_when_not_set():
    ledger = DispatchLedger({f"s{i}": 1.0 for i in range(3)}, workers=3, straggler_factor=2.0)
    runs = _launch_all(ledger)
    for run_id in runs:
        ledger.seen_working(run_id, 0.0)
    assert ledger.straggler_deadline() is None and ledger.stragglers(1000.0) == []
    ledger.mark_finished(ledger.runs[runs[0]].shard_ids)
    ledger.run_ended(runs[0], "COMPLETED", 30.0)
    assert ledger.straggler_deadline() == 60.0
    assert ledger.stragglers(59.0) == []
    assert {r.run_id for r in ledger.stragglers(61.0)} == set(runs[1:])


def test_a_run_whose_shards_all_finished_elsewhere_is_redundant_and_not_counted_lost():
    ledger = _ledger(straggler_seconds=1.0)
    first, second = _launch_all(ledger)
    ledger.seen_working(first, 0.0)
    copy = ledger.speculative_copy(ledger.runs[first])
    ledger.launched(copy, "copy", "w0-copy", 2.0)
    ledger.mark_finished(copy.shard_ids)
    ledger.run_ended("copy", "COMPLETED", 5.0)
    assert [r.run_id for r in ledger.redundant()] == [first]
    ledger.cancelled.add(first)
    ledger.run_ended(first, "CANCELLED", 6.0)
    ledger.mark_finished(ledger.runs[second].shard_ids)
    ledger.run_ended(second, "COMPLETED", 7.0)
    metrics = fleet_metrics(ledger, [])
    assert metrics["worker_runs"] == 3 and metrics["worker_runs_lost"] == 0
    assert metrics["speculative_copies"] == 1 and metrics["dispatch_rounds"] == 1


def _result(shard_id: str, worker: str, tokens: int, seconds: float) -> ShardResult:
    return ShardResult(shard_id=shard_id, fingerprint="f", uri="u", output="o", rows_in=10, rows_out=10,
                       rows_rejected=0, rows_truncated=0, input_tokens=tokens, output_tokens=0, batches=1,
                       real_tokens=tokens, padded_slots=tokens, baseline_padded_slots=tokens,
                       engine_seconds=seconds, seconds=seconds, worker=worker)


def test_per_worker_throughput_counts_the_results_each_run_wrote():
    ledger = _ledger()
    _launch_all(ledger)
    results = [_result("s0", "w0", 1000, 2.0), _result("s1", "w0", 1000, 2.0), _result("s2", "w1", 600, 3.0),
               _result("old", "earlier-run", 5000, 1.0)]
    rows = worker_rows(list(ledger.runs.values()), results, set(ledger.weights))
    assert [(r["worker"], r["shards_written"], r["tokens_per_s"]) for r in rows] == [("w0", 2, 500.0),
                                                                                  ("w1", 1, 200.0)]
    metrics = fleet_metrics(ledger, rows)
    # fixed names, whatever the runs are called: a metric name per worker run would grow without bound
    assert not [k for k in metrics if k.startswith("worker/")]
    assert (metrics["worker_tokens_per_s_min"], metrics["worker_tokens_per_s_median"],
            metrics["worker_tokens_per_s_max"]) == (200.0, 350.0, 500.0)


def test_worker_summary_leaves_out_runs_that_wrote_nothing():
    rows = [{"worker": f"job-r1-w{n}", "tokens_per_s": tps, "shard_seconds": secs}
            for n, (tps, secs) in enumerate([(500.0, 4.0), (200.0, 3.0), (300.0, 2.0), (0.0, 0.0)])]
    assert worker_summary_metrics(rows) == {"worker_tokens_per_s_min": 200.0, "worker_tokens_per_s_median": 300.0,
                                            "worker_tokens_per_s_max": 500.0}
    assert worker_summary_metrics(rows[3:]) == {}


def test_shards_carry_their_size_for_balancing_but_not_in_their_fingerprint(tmp_path):
    texts = [("word " * (5 + i % 50)).strip() for i in range(1000)]
    path = write_parquet(tmp_path / "a.parquet", [str(i) for i in range(1000)], texts, row_group_size=100)
    shards = discover_shards(str(path), max_shard_rows=250)  # cuts through row groups
    metadata = pq.ParquetFile(path).metadata
    total = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    assert all(s.data_bytes > 0 for s in shards)
    assert abs(sum(s.data_bytes for s in shards) - total) <= len(shards)
    assert _finish(shards[0].model_copy(update={"data_bytes": 1})).fingerprint == shards[0].fingerprint

    lines = "".join(f'{{"id": "{i}", "text": "{t}"}}\n' for i, t in enumerate(texts))
    (tmp_path / "b.jsonl").write_text(lines)
    jsonl = discover_shards(str(tmp_path / "b.jsonl"), max_shard_bytes=4096)
    assert sum(s.data_bytes for s in jsonl) == len(lines.encode())


def test_workers_read_the_orchestrators_shard_list_and_unknown_ids_are_named(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", [str(i) for i in range(40)], ["x"] * 40, row_group_size=10)
    shards = discover_shards(str(path), max_shard_rows=10)
    store = OutputStore(str(tmp_path / "out"))
    uri = write_shard_list(store, shards)
    assert write_shard_list(store, shards) == uri  # named by content
    assert read_shard_list(store, uri) == shards
    picked = select_shards(shards, [shards[2].shard_id, shards[0].shard_id], uri)
    assert picked == [shards[2], shards[0]]
    with pytest.raises(ConfigError, match="not-a-shard"):
        select_shards(shards, ["not-a-shard"], uri)


def test_a_run_no_worker_picks_up_is_abandoned_counted_lost_and_its_shards_go_to_the_next_round():
    ledger = _ledger(start_timeout=60.0)
    first, second = _launch_all(ledger, now=0.0)
    ledger.seen_running(second, 5.0)
    assert ledger.never_started(59.0) == []
    assert [r.run_id for r in ledger.never_started(61.0)] == [first]
    ledger.abandoned.add(first)
    assert ledger.never_started(62.0) == []  # cancelled once
    again = ledger.run_ended(first, "CANCELLED", 63.0, "abandoned: it never started")
    assert again[0].shard_ids == ledger.runs[first].shard_ids and again[0].round == 2
    assert fleet_metrics(ledger, [])["worker_runs_lost"] == 1
