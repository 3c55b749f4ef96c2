"""bench/run.py's report writer: a results object in, RESULTS.md's rows out. No engine starts."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is not an installed package; `python -m pytest` from the root has it
    sys.path.insert(0, str(ROOT))

from bench import run as bench  # noqa: E402


def timed(name: str, seconds: list[float], tokens: int = 10_000, items: int = 100,
          padded_slots: int | None = None) -> bench.Variant:
    return bench.Variant(name, None, tokens, items, padded_slots, seconds)


def results(memory: bool = True) -> bench.BenchResults:
    tokenmill_vllm = timed("tokenmill end to end (vLLM)", [2.1, 2.0, 1.9])  # median 2.0: 5,000 tokens/s
    return bench.BenchResults(
        command="python -m bench.run --repeats 3 ",
        machine={"date": "2026-11-22 14:59 UTC", "commit": "abc1234", "cpu": "Test CPU", "flags": ["avx512_vnni"],
                 "cores": 2, "ram_gib": 24.0, "gpu": None, "python": "3.11.7"}, docs=100, tokens=10_000, repeats=3,
        end_to_end=bench.EndToEndVsDirect(tokenmill=tokenmill_vllm,
                                          direct=timed("vLLM LLM.embed(texts) directly", [1.6, 1.6, 1.6])),
        offline=bench.OfflineVsOneAtATime(
            vllm_batches=timed("vLLM, our batches", [0.5], 2560, 32),
            vllm_single=timed("vLLM, one request at a time", [2.0], 2560, 32),
            transformers_batches=timed("transformers, our batches", [0.1], 2560, 32),
            transformers_single=timed("transformers, one request at a time", [4.0], 2560, 32)),
        buckets=bench.BucketsVsInputOrder(
            bucketed=timed("transformers, length buckets", [1.0], padded_slots=10_200),
            input_order=timed("transformers, input order", [4.0], padded_slots=25_000)),
        sentence_transformers=bench.VsSentenceTransformers(
            encode=timed("sentence-transformers encode (batch 32)", [4.0]),
            tokenmill_transformers=timed("tokenmill end to end (transformers)", [2.5]),
            tokenmill_vllm=tokenmill_vllm),
        engines_embed=bench.VllmVsTransformersEmbed(
            vllm=timed("vLLM engine, our batches", [1.25], padded_slots=10_200),
            transformers=timed("transformers engine, our batches", [2.0], padded_slots=10_200)),
        engines_generate=bench.VllmVsTransformersGenerate(
            vllm=timed("vLLM generate", [0.5], 320, 4), transformers=timed("transformers generate", [2.0], 320, 4),
            max_tokens=32, output_tokens={"vllm": 120, "transformers": 110}),
        memory=bench.MemoryScaling(x1=bench.PeakMemoryOfRun(rows=100, peak_tree_gib=2.0, peak_main_gib=1.0, wall_s=9),
                                   x10=bench.PeakMemoryOfRun(rows=1000, peak_tree_gib=2.5, peak_main_gib=1.1,
                                                             wall_s=30)) if memory else None,
        profile_text="12.1 profile  bench/run.py\n",
    )


TARGET_ROWS = [
    ("| tokenmill end to end vs the same engine called directly | 0.80× | ≥ 0.90 | no | 5,000 vs 6,250 tokens/s; "
     "ours reads Parquet, validates, tokenizes, buckets and writes Parquet |"),
    ("| offline batches vs one request at a time (vLLM) | 4.0× items/s | ≥ 20× | no "
     "| 64.0 vs 16.0 items/s on 32 docs |"),
    ("| offline batches vs one request at a time (transformers) | 40.0× items/s | ≥ 20× | yes "
     "| 320.0 vs 8.0 items/s on 32 docs |"),
    ("| transformers engine, buckets on vs off (same token budget) | 4.00× tokens/s; padding 2.0% vs 60.0% "
     "| ≥ 2×; padding ≤ 5% | yes | 100 docs |"),
    ("| our best engine vs sentence-transformers encode | 2.00× | ≥ 1.0× | yes | tokenmill end to end (vLLM): "
     "5,000 vs 2,500 tokens/s; tokenmill on transformers: 1.60× |"),
    "| vLLM vs transformers engine, embed | 1.60× | report | — | 8,000 vs 5,000 tokens/s, same batches |",
    ("| vLLM vs transformers engine, generate | 4.00× | report | — | 4 prompts, max_tokens 32: 0.50 s vs 2.00 s; "
     "output tokens 120 vs 110 |"),
    ("| peak memory, 10× corpus vs 1× | 1.25× | ≤ 1.2× | no | process tree 2.00 → 2.50 GiB; driver alone "
     "1.00 → 1.10 GiB (1.10×); 100 → 1000 rows |"),
]


def table_after(text: str, heading: str) -> list[str]:
    lines = text.split(heading, 1)[1].strip().splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_report_renders_the_targets_table(tmp_path):
    path = tmp_path / "nested" / "RESULTS.md"
    bench.write_report(results(), path)
    text = path.read_text()

    assert text.startswith("# tokenmill benchmarks\n\nWritten by `python -m bench.run --repeats 3`")
    assert ("- **Date:** 2026-11-22 14:59 UTC\n- **Commit:** abc1234\n- **Machine:** Test CPU (avx512_vnni), 2 logical "
            "cores, 24 GiB RAM; GPU: none; Python 3.11.7\n") in text
    assert "- **Corpus:** 100 documents of the sample corpus (10,000 tokens after truncation at 256)" in text
    assert "the order reversed every other round) after one warm-up run each;\n  3 rounds; medians and ratios." in text
    assert table_after(text, "## Against the targets") == [
        "| comparison | measured | target | met | note |", "|---|---|---|---|---|", *TARGET_ROWS]
    assert "```\n12.1 profile  bench/run.py\n```\n" in text


def test_report_lists_every_variant_in_run_order(tmp_path):
    path = tmp_path / "RESULTS.md"
    bench.write_report(results(), path)
    rows = table_after(path.read_text(), "## Every variant")

    assert rows[:2] == ["| variant | median s | runs (s) | tokens/s | items/s | padding |", "|---|---|---|---|---|---|"]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows[2:]] == [
        "tokenmill end to end (vLLM)", "vLLM LLM.embed(texts) directly", "vLLM, our batches",
        "vLLM, one request at a time", "transformers, our batches", "transformers, one request at a time",
        "transformers, length buckets", "transformers, input order", "sentence-transformers encode (batch 32)",
        "tokenmill end to end (transformers)", "vLLM engine, our batches", "transformers engine, our batches",
        "vLLM generate", "transformers generate"]
    assert rows[2] == "| tokenmill end to end (vLLM) | 2.00 | 2.10, 2.00, 1.90 | 5,000 | 50.0 |  |"
    assert rows[8] == "| transformers, length buckets | 1.00 | 1.00 | 10,000 | 100.0 | 2.0% |"


def test_without_memory_runs_the_memory_row_and_figures_are_left_out(tmp_path):
    path = tmp_path / "RESULTS.md"
    bench.write_report(results(memory=False), path)

    assert table_after(path.read_text(), "## Against the targets")[2:] == TARGET_ROWS[:-1]
    assert not {"memory_10x_vs_1x", "memory_main_10x_vs_1x"} & set(bench.figures(results(memory=False)))


def test_figures_name_every_ratio_and_variant():
    figures = bench.figures(results())

    assert figures["e2e_vs_direct"] == pytest.approx(0.8)
    assert figures["offline_vs_single"] == pytest.approx(4.0)
    assert figures["offline_vs_single_transformers"] == pytest.approx(40.0)
    assert figures["buckets_speedup"] == pytest.approx(4.0)
    assert figures["padding_bucketed"] == pytest.approx(0.02, abs=1e-3)
    assert figures["padding_input_order"] == pytest.approx(0.6)
    assert figures["best_vs_sentence_transformers"] == pytest.approx(2.0)
    assert figures["vllm_vs_transformers_embed"] == pytest.approx(1.6)
    assert figures["vllm_vs_transformers_generate"] == pytest.approx(4.0)
    assert figures["memory_10x_vs_1x"] == pytest.approx(1.25)
    assert figures["memory_main_10x_vs_1x"] == pytest.approx(1.1)
    assert figures["tokens_per_s.tokenmill_end_to_end__vllm"] == pytest.approx(5000)
    assert sum(key.startswith("tokens_per_s.") for key in figures) == 14


def test_quick_changes_the_defaults_only():
    quick = bench.parse_args(["--quick", "--repeats", "2"])
    assert (quick.docs, quick.repeats, quick.single_docs, quick.generate_docs) == (32, 2, 8, 4)
    assert quick.results != bench.RESULTS and quick.experiment == "tokenmill-bench-quick"
    full = bench.parse_args([])
    assert (full.docs, full.repeats, full.results, full.experiment) == (1000, 3, bench.RESULTS, "tokenmill-bench")


def test_whole_run_report_states_ratios_against_the_goals():
    from pathlib import Path

    from bench import whole

    def tokenmill_run(wall, engine_s, predicted, measured):
        return whole.Run(wall, engine_s, metrics={"fixed_seconds": 9.0, "predicted_wall_seconds": predicted,
                                                  "measured_wall_seconds": measured},
                         params={"engine": "transformers"})

    st = whole.Variant("sentence-transformers script", ["python", "bench/baselines/st_embed.py"], Path("x"), "script",
                       runs=[whole.Run(60.0, 45.0), whole.Run(62.0, 46.0)])
    ours = whole.Variant("tokenmill run", ["python", "-m", "tokenmill.cli"], Path("y"), "tokenmill",
                         runs=[tokenmill_run(40.0, 30.0, 44.0, 39.0), tokenmill_run(42.0, 31.0, 44.0, 41.0)],
                         warmup=whole.Run(90.0))
    raw = whole.Variant("LLM.chat, one call", ["python", "bench/baselines/vllm_chat.py"], Path("z"), "script",
                        runs=[whole.Run(80.0, 40.0)])
    gen = whole.Variant("tokenmill run", ["python", "-m", "tokenmill.cli"], Path("w"), "tokenmill",
                        runs=[tokenmill_run(100.0, 50.0, 90.0, 100.0)], warmup=whole.Run(150.0))
    forced = whole.Variant("tokenmill run --engine vllm", ["python", "-m", "tokenmill.cli"], Path("v"), "tokenmill",
                           runs=[tokenmill_run(160.0, 44.0, 150.0, 160.0)])
    text = whole.render({"embed short": [st, ours], "generate summary": [raw, gen, forced]},
                        {"embed short": {"rows": 3000}, "generate summary": {"rows": 96}}, rounds=2)
    # walls 61 s / 41 s, engines 45.5 / 30.5 s; predicted 44 s against 39 and 41 s: +12.8% and +7.3%, median +10.1%
    assert ("| embed short | tokenmill run | sentence-transformers script | 1.49× | ≥ 1.2× | yes | 1.49× | +10.1% "
            "| 90.0 s |") in text
    assert "| generate summary | tokenmill run | LLM.chat, one call | 0.80× | ≥ 0.9× | no | 0.80× | -10.0% | 150.0 s |" in text
    # every tokenmill variant is set against the script: the vLLM feed against one LLM.chat call, engine to engine
    assert ("| generate summary | tokenmill run --engine vllm | LLM.chat, one call | 0.50× | ≥ 0.9× | no | 0.91× "
            "| -6.2% | not run (--no-warmup) |") in text
    assert "| embed short | 3,000 | tokenmill run | 41.0 | 40.0, 42.0 | 30.5 | transformers | 9.0 | 44.0 |  |" in text


# --- bench/harness.py: what every bench shares ---------------------------------------------------------------

from bench import harness  # noqa: E402


def test_rounds_alternate_their_order_after_one_warm_up_of_each():
    calls: list[str] = []
    variants = [harness.Variant(name, lambda name=name: calls.append(name) or name, tokens=10, items=2)
                for name in "abc"]
    ticks: list[str] = []
    harness.interleave(variants, rounds=4, sync=lambda: ticks.append("sync"))

    assert harness.round_orders(3, 4) == [[0, 1, 2], [2, 1, 0], [0, 1, 2], [2, 1, 0]]
    assert calls == list("abc") + list("abc") + list("cba") + list("abc") + list("cba")
    assert [len(v.seconds) for v in variants] == [4, 4, 4] and all(v.last == v.name for v in variants)
    assert len(ticks) == 2 * 12  # before and after every timed run, not around the warm-ups
    assert variants[0].tokens_per_s == 10 / variants[0].median


def test_interleave_without_warm_up_times_every_call():
    calls: list[str] = []
    variants = [harness.Variant(name, lambda name=name: calls.append(name)) for name in "ab"]
    harness.interleave(variants, rounds=3, warmup=False)
    assert calls == ["a", "b", "b", "a", "a", "b"]


ALLOCATE = "b = bytearray({mib} * 2**20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(0.6)"


def test_whole_process_runner_reads_the_peak_memory_of_a_real_process():
    run = harness.run_process([sys.executable, "-c", ALLOCATE.format(mib=220)])
    assert run.returncode == 0 and run.wall_s > 0.5
    assert run.peak_bytes >= 200 * 2**20, run
    assert run.peak_root_bytes >= 200 * 2**20


def test_whole_process_runner_sums_the_process_tree():
    # the parent holds ~150 MiB and its child another ~150 MiB at the same time: only the tree's sum passes 250
    child = ALLOCATE.format(mib=150)
    parent = (f"import subprocess, sys; b = bytearray(150 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
              f"subprocess.run([sys.executable, '-c', {child!r}], check=True)")
    run = harness.run_process([sys.executable, "-c", parent], interval=0.05)
    if run.sampler.startswith("getrusage"):
        pytest.skip("psutil is not installed: the fallback reads the largest single process only")
    assert run.peak_bytes >= 250 * 2**20 and run.peak_root_bytes < 250 * 2**20, run


def test_a_failed_process_names_its_command_and_output():
    run = harness.run_process([sys.executable, "-c", "import sys; sys.exit('no such corpus: x.parquet')"])
    with pytest.raises(RuntimeError, match="tiny job exited 1:\nno such corpus: x.parquet"):
        run.check("tiny job")


def test_header_states_date_commit_and_machine_and_the_index_reads_them_back(tmp_path):
    info = harness.machine()
    assert {"date", "commit", "cpu", "flags", "cores", "ram_gib", "gpu", "python"} <= info.keys()
    assert info["cores"] >= 1 and info["ram_gib"] > 0 and info["cpu"]
    assert set(info["flags"]) <= set(harness.FLAGS)
    assert info["commit"] and info["commit"].split()[0].isalnum()  # the tests run in a git checkout
    lines = harness.header("A comparison", "python -m bench.example", info)
    assert lines[:3] == ["# A comparison", "", "Written by `python -m bench.example`; do not edit by hand."]
    assert f"- **Machine:** {harness.machine_line(info)}" in lines
    report = tmp_path / "EXAMPLE.md"
    report.write_text("\n".join(lines + ["", *harness.table(("a", "b"), [(1, None), ("x|y", 2)])]) + "\n")
    read = harness.report_header(report)
    assert read == {"title": "A comparison", "date": info["date"].removesuffix(" UTC"),
                    "commit": info["commit"].split()[0][:7]}
    assert report.read_text().endswith("| a | b |\n|---|---|\n| 1 |  |\n| x\\|y | 2 |\n")


def test_the_report_index_lists_every_report_with_a_date():
    reports = sorted(p.name for p in (ROOT / "bench").glob("*.md") if p.name != "README.md")
    rows = harness.report_index()[2:]
    assert [row.split("](")[0].removeprefix("| [") for row in rows] == reports
    for row in rows:
        date = row.split(" | ")[3]
        assert harness._DATE.match(date), row
    committed = (ROOT / "bench" / "README.md").read_text()
    index = committed.split(harness.INDEX_START)[1].split(harness.INDEX_END)[0]
    missing = [name for name in reports if f"[{name}]({name})" not in index]
    assert not missing, f"bench/README.md's index lacks {missing}: run `make bench-index`"


def test_write_index_keeps_the_prose_around_it(tmp_path):
    (tmp_path / "README.md").write_text("# Benchmarks\n\nProse above.\n")
    (tmp_path / "X.md").write_text("# X\n\n- **Date:** 2026-11-25 03:00 UTC\n- **Commit:** abcdef1\n")
    harness.write_index(tmp_path)
    harness.write_index(tmp_path)  # again: replaced in place, not added twice
    text = (tmp_path / "README.md").read_text()
    assert text.count(harness.INDEX_START) == 1 and "Prose above." in text
    assert "| [X.md](X.md) | X | — | 2026-11-25 03:00 | abcdef1 |" in text


def test_the_harness_imports_only_the_standard_library():
    # bench/gpu.py imports it on a GPU machine with no venv; psutil is optional there
    import ast

    tree = ast.parse((ROOT / "bench" / "harness.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - set(sys.stdlib_module_names) == {"psutil"}


def test_the_row_cache_report_gives_the_short_re_runs_median_wall_their_range_and_the_load(tmp_path):
    from bench import row_cache
    from bench.whole import Run, Variant

    def variant(key: str, walls: list[float], **metrics: float) -> tuple[Variant, Run]:
        runs = [Run(w, metrics={"engine_tokens": 1000.0, "engine_seconds": 8.0, "shards": 1.0, **metrics})
                for w in walls]
        made = Variant(key, [], tmp_path, runs=runs)
        return made, row_cache.median_run(made)

    results = {"first": variant("first run", [100.0]), "first-off": variant("first run, off", [101.0]),
               "edited": variant("edited", [30.0, 20.0, 21.0], engine_tokens=50.0),
               "edited-off": variant("edited, off", [99.0]),
               "appended": variant("appended", [24.0, 22.0], engine_tokens=40.0),  # even count: the lower middle
               "unchanged": variant("unchanged", [15.0, 9.0, 10.0], engine_tokens=0.0, shards_cached=1.0),
               "unchanged-off": variant("unchanged, off", [8.0, 12.0, 9.5], engine_tokens=0.0, shards_cached=1.0),
               "dup": variant("dup", [40.0], engine_tokens=700.0), "dup-off": variant("dup, off", [50.0])}
    assert results["edited"][1].wall == 21.0 and results["appended"][1].wall == 22.0
    text = row_cache.render(results, 7000, {"first": [9.0], "edited": [3.0, 8.5, 5.0]})
    assert "| edited | 21.0 (20.0-30.0, 3 rounds) |" in text and "| 3.0-8.5 |" in text
    assert "| first run | 100.0 | 8.0 |" in text and "| re-run, 5% of rows edited: wall time | 21.0% | ≤ 25% | yes |" in text
    assert "3.0 to 9.0 (median 6.8) on" in text and "the edit, append and nothing-changed re-runs 3 rounds each" in text
    assert "10.0 s (without the row cache 9.5 s)" in text
    assert "against the faster of the two (100.0 s) the edit and append re-runs are 21.0% and 22.0%" in text
    assert row_cache.render(results, 7000, machine={**harness_machine(), "date": "then"}).count("**Date:** then") == 1


def harness_machine() -> dict:
    from bench import harness

    return harness.machine()


def test_the_prediction_bench_reads_steal_from_the_cores_clock_ticks():
    """bench/prediction.py's per-job steal: the hypervisor's share of the cores' time between two /proc/stat
    readings (user, nice, system, idle, iowait, irq, softirq, steal, guest, guest_nice), guest not counted twice."""
    from bench import prediction

    before = [100, 0, 50, 800, 10, 0, 0, 40, 30, 0]
    after = [190, 0, 70, 960, 10, 0, 0, 70, 60, 0]  # 90 + 20 + 160 + 30 steal = 300 ticks, guest inside user
    assert prediction.steal_share(before, after) == pytest.approx(30 / 300)
    assert prediction.steal_share(None, after) is None and prediction.steal_share(before, before) is None
    assert prediction.steal_share(before[:4], after[:4]) is None  # a kernel without the steal column
    now = prediction.cpu_times()
    if now is not None:  # Linux: this machine's own counters, and a share between 0 and 1 over a moment
        assert len(now) >= 8 and 0.0 <= (prediction.steal_share(now, prediction.cpu_times()) or 0.0) <= 1.0
