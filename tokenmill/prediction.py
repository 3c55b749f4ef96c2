"""How long a job takes as a whole process on this machine, from measured parts; afterwards, checked.

    wall = python imports + orchestration start + eval gate (a gated job's) + engine trials (when they
           will run) + engine start + engine seconds + shard overhead + index build + finish + exit

- orchestration start is the critical path of what `tokenmill run` overlaps (tasks/warm.py): Prefect's
  API starts in its own process while the main thread imports the flow, predicts and starts the engine,
  so it costs max(API, main thread + engine start) - engine start, plus the flow's own start (and before
  them, a first command's model probe, which `tokenmill run` runs before the API starts). Its parts
  are measured apart, so figures measured beside vLLM's 40 s start hold for transformers' 0.2 s one.
- engine seconds: the rows still to compute (finished shards, the rows the row cache holds, and
  repeats of an identical input, which the run computes once, left out) at their lengths, from the
  job's own sample: each row's tokens / tokens_per_s(length), the rate read off the curve over length
  that this job's trials and runs measured here (log-log between them, flat beyond). Generation is not
  tokens over one rate: its seconds are its calls' seconds (tokenmill.call_costs), each call planned as the
  runner plans it, its steps the expected longest answer of its rows, at the costs fit to the generation
  calls measured here (the trials' and the runs'); the rate curve only until two widths of calls were seen.
- engine trials, when this run pays for them: measured here for this model and mode, else each engine
  the trial will start at its stated defaults (start, plus the trial's own rows at a default rate).
- every other part is measured seconds, stored per engine and device (the engine's start per
  model; the trials per model) in `run-parts.json` beside the engine trials (`TOKENMILL_CACHE_DIR`),
  each the median of the last KEEP_LAST runs that measured it (one loaded run moves a median of five
  little). Nothing is a factor fitted to another job's wall time.
- a part never measured here is named in the prediction as a default, with its value.
- a job with an eval gate: the gate's seconds as gates of the same models and sample size measured here,
  then the corpus on the model this machine's kept verdict on the job's sample picks, else the one the
  gate's verdict on another corpus here picked, else the candidate cheapest at the default rates
  (predict_gated); the gate's seconds are not the flow's start, and its engines' starts not the corpus's.
  Which model the gate picks is a measurement (its metrics against their thresholds), not a time: where the
  gate measures, the prediction carries the corpus on each model it may pick (branches), and the run's record
  holds the one that ran beside the measured wall (`predicted_wall_seconds_as_gated`), its own error unchanged.
- models made once per machine (ONNX exports, quantized copies) where they are not made yet, at what
  making one of that name took here (models_to_make); the runs store their parts without that making.

`tokenmill plan`, `tokenmill calibrate` and `tokenmill run` all call `predict_job`, so one job
gets one line. The run makes its prediction before it starts the job's work and its record holds it
beside what it measured: wall, engine and fixed seconds. What `tokenmill run` measures before it predicts,
the prediction holds as measured: a first command's model probe, an embedding gate with no verdict here on
its sample (tokenmill.gate.judge_first), auto's embedding trials with none here at the job's length
(trials_ahead: after the API's start, which it waits out, as the early start ran them), a generation corpus's
answers' probe (tokenmill.answer_probe). `plan` and `calibrate` predict a run as it will run: these parts from
the figures kept here, or before any, from the stated defaults.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from tokenmill import call_costs, timeline
from tokenmill.answer_probe import probe_answers
from tokenmill.device import (core_gflops, device_label, interpreter_ms, model_tokens_per_s, start_interpreter_probes,
                              take_interpreter_probes, usable_cores)
from tokenmill.engine_choice import (
    TRIAL_MAX_TOKENS,
    TRIAL_ROWS,
    answers_at_cap,
    answers_key,
    cache_dir,
    chosen_engine,
    class_rates,
    engine_trials,
    length_class,
    other_width_call,
    output_tokens_per_row,
    prefill_rows,
    rates_key,
    restart_seconds,
    runnable_engines,
    sampled_inputs,
    split_warm,
    trial_order,
    trials_cached,
    weighed_start,
)
from tokenmill.digest import stable_digest
from tokenmill.json_store import read_json, rewrite_json
from tokenmill.gate import (GATE_CACHE_VERSION, GATE_FIRST, UNTIMED_PASS_MODE, GateReport, candidate_models, chosen_model,
                            job_for, known_verdict, last_verdict_elsewhere, model_label, pick_cheapest)
from tokenmill.models import resolve_model
from tokenmill.onnx_models import MADE_SPANS, cpu_flags, int8_isa, made_seconds, model_folder, onnx_steps
from tokenmill.openvino_engine import calibration
from tokenmill.openvino_models import openvino_step
from tokenmill.outputs import MANIFEST, OutputStore
from tokenmill.planning import row_cache_share, rows_per_shard
from tokenmill.prompts import TEXT, prompt_columns, text_column_used
from tokenmill.row_cache import bypass_reason, cache_uri
from tokenmill.runner import engine_pads, plan_feed
from tokenmill.shards import discover_shards_for, read_shard
from tokenmill.spec import JobSpec, ModelSpec, local_tracking_store
from tokenmill.vllm_engine import graphs_kept

# For a part never measured on this machine: seconds (per 1,000 rows where the name says so), stated
# with the prediction. What a quiet 2-core CPU (CI's machine type) measured in bench/PREDICTION.md's runs
# (API 2.8-3.4 s, imports 1.3-1.4 s, main thread 1.8-2.6 s embedding and 6-7 s generating, flow start
# 0.2-0.3 s); on a loaded one the API takes 10-15 s. A GPU host's differ: there they are guesses. The main
# thread's is besides the reading of the job's sample (READING) and MLflow's store (TRACKING_OPENED): 1.6-1.8 s
# with the store on a quiet 2-core Xeon, whose opening took 1.4-1.5 s of it (MLflow's import included).
MAIN = "main thread besides the sample and MLflow's store"
DEFAULT_SECONDS = {
    "python imports": 1.4, "orchestrator API": 3.5, MAIN: 0.4, "flow start": 0.3,
    "shard overhead per 1,000 rows": 0.6, "index build per 1,000 rows": 1.0, "finish": 0.1,
}
# A run that opens no engine (every shard finished, no trial) exits without closing one: the record's logging,
# the orchestrator's shutdown and the interpreter's, stored apart from the engines' exits it would pull down.
# Per engine, never read from another's: what the process imported to choose or name its engine is torn down
# with it. A 2-core AMD EPYC at speed 0.87-0.95 (2026-11-28): 1.97 and 2.01 s for reruns of vLLM and auto jobs
# (torch imported; their vLLM runs' exits took 3.2 s), 0.76 s for `make run`'s rerun on OpenVINO (no torch;
# its run's exit 1.6 s). The record imported torch to name the device where no engine had (engine_device): it
# no longer does, and an AMX Xeon at speed ~1.15 (2026-12-05) exited 20,000 rows' transformers rerun in 0.71-0.74 s
# where it took 2.63 with torch, and a SmolLM2 rerun (transformers imported for its chat template) in 1.05 where
# it took 1.98: 0.8 for all at speed 1.
IDLE_EXIT = "exit, no engine"
DEFAULT_IDLE_EXIT = {"vllm": 0.8, "transformers": 0.8, "onnxruntime": 0.8, "openvino": 0.8}
# A run whose eval gate measured its models exits with them: the reference's engine and the candidates' as well as
# the corpus's, whatever the corpus ran on. Stored apart from the corpus engine's exit: on the 2-core EPYC
# (speed 0.82-0.89, runs 22b-23b) `make run`'s gate on OpenVINO exited in 0.8-1.4 s where gated, 0.5-0.7 s with its
# verdict kept (OpenVINO's alone), which read the gate's 1.4 s (+11.1% on a 9-second job, 22b). Runs 24a-26b there
# (speed 0.84-0.98): 1.4, 1.3, 0.7, 0.9, 0.6 and 0.5 s, where 1.3 put each at 1.2-1.3 s: 1.0, their median at speed 1.
GATE_EXIT = "exit, after a measuring gate"
DEFAULT_GATE_EXIT = 1.0
# The shard overhead's default is per 1,000 rows of ~256 tokens (length class 8), in proportion to the rows'
# length: a host of speed ~2.2 measured 1.4-1.5 s per 1,000 rows of ~255 tokens, 0.25-0.3 of ~55-64, 0.0-0.1 of ~19.
OVERHEAD_DEFAULT_LENGTH = 8
# Parts of the process around the engine, the same whichever engine runs: a device and mode's runs on one
# engine stand for another never measured. Not the exit, which holds the engine's own shutdown.
# The main thread's work measured in a run that paid for trials (less the trials and its wait for the API):
# it ran beside less of the API's start than a warm run's does, so it stands in only where no warm run
# measured MAIN.
MAIN_BESIDE_TRIAL = f"{MAIN}, a run with trials"
# ...scaled by this: a first run's main thread does once what later runs' do not (its imports' first compiles of
# what the engines' choice pulls in), and in the bench's first and warm runs it read 0.6-1.0 s where the warm
# run's read 0.4-0.9 (8 rounds on three 2-core hosts, 2026-11-25 to 29: warm over first 0.57-1.0, median 0.71),
# which put the warm embedding job 0.2-0.3 s over on its 8-10 fixed seconds in each of them.
MAIN_FROM_TRIAL = 0.7
# The main thread's work where no engine starts beside the API (a gated job's: its gate starts the engines in
# the flow): it imports alone what MLflow and matplotlib share with an engine's import, which a started
# engine's span holds otherwise. Stored apart; never measured, MAIN and this (the quiet 2-core Xeon,
# 2026-11-27: 2.7-2.8 s in gated jobs against 1.9-2.3 s in the others). A rerun with nothing left to compute
# starts no engine either: it reads and stores this one.
MAIN_ALONE = f"{MAIN}, no engine starting beside it"
DEFAULT_ALONE_EXTRA = 0.6
# ...and where that run is the machine's first (its API created the database: `make run` on a new machine), its
# main thread pays once for what later runs' do not (a fresh clone's own modules compiled, files read from a cold
# disk cache): stored apart, and read x MAIN_FROM_TRIAL where no later run measured MAIN_ALONE. `make run` in a
# fresh clone on an AMX Xeon (2026-12-05): 1.36 s, its rerun 0.71, which the first's figure put at +10.2%.
MAIN_FIRST_ALONE = f"{MAIN_ALONE}, the machine's first run"
AROUND_THE_ENGINE = frozenset(DEFAULT_SECONDS) | {MAIN_BESIDE_TRIAL, MAIN_ALONE, MAIN_FIRST_ALONE}
# The prediction reads and tokenizes the job's sample on the main thread (job_sample), inside what the API's
# start overlaps: seconds that grow with the tokens it reads (0.14 s for 1,000 rows of ~19 tokens, 0.48 s
# for 500 of ~255 on a quiet 2-core Xeon, in the run's own process), on top of loading the tokenizer
# (generation's loads transformers for the chat template: 3.5-3.9 s there). Stored per device and mode,
# each run's seconds beside the tokens it read (READ_TOKENS), and read as the line through them; never
# measured, these at machine speed 1.
READING, READ_TOKENS = "reading the sample", "tokens the sample read"
DEFAULT_READING = {"embed": 0.08, "generate": 3.6}
DEFAULT_READING_PER_TOKEN = 2.1e-6
# ...and beside the characters it read (READ_CHARS): reading and tokenizing a row costs by its text, not by the
# tokens truncation keeps of it. 1,500 docstrings of installed packages, 3,347 characters a row (JSONL), read
# 449,536 tokens (5.77M characters) in 4.05-4.17 s where the line through the runs' tokens before them said 1.7
# (an AMX Xeon at speed 1.12-1.16, 2026-12-05): 0.59-0.61 us a character at speed 1, `make run`'s sample corpus
# (1.31M characters in 0.87-0.94 s) 0.53, the first figures above (500 rows of ~1,180 characters in 0.48 s)
# 0.68. Never measured, this at speed 1.
READ_CHARS = "characters the sample read"
DEFAULT_READING_PER_CHAR = 0.55e-6
# The main thread opens the job's MLflow store (tasks/warm.py warm_tracking); a local SQLite store that does
# not exist yet is created first, its tables and all: a first run's cost, stored apart from a later run's
# opening under machine_key() (any job's store, on this machine), and predicted by whether the store is there.
# A later run's opening is stored per mode (f"{TRACKING_OPENED}@{mode}"): it runs beside the engine's early
# start, and generation's took longer (a 2-core Xeon with AMX, run 21a: 3.8-4.6 s in generation's runs,
# 2.5-3.7 s in embedding's); a mode never measured reads the other's.
# Never measured, these at machine speed 1 (the quiet 2-core Xeon: MLflow's import and the client, ... s
# opening, ... s creating).
TRACKING_OPENED, TRACKING_CREATED = "MLflow's store, opened", "MLflow's store, created"
DEFAULT_TRACKING = {TRACKING_OPENED: 1.4, TRACKING_CREATED: 2.3}
# Where no engine started before the store's opening in the process (MAIN_ALONE's runs: a gated job's, whose gate
# starts the engines in the flow, and a rerun with nothing left to compute), the opening imports alone what MLflow
# shares with an engine's import: stored apart, per mode (f"{TRACKING_ALONE}@{mode}"). On the 2-core EPYC with
# AVX-512 (bench/PREDICTION.md runs 37a-38c, speed 0.96-1.3) the gated jobs' openings took 1.6-2.5 s, each run's
# 0.3-0.6 s (median 0.55) over its other embedding jobs' median (1.3-1.6 s), which put every verdict-kept rerun
# under. Never measured alone here: the opening after an engine's start, + this at speed 1.
TRACKING_ALONE = f"{TRACKING_OPENED}, no engine started before it"
DEFAULT_TRACKING_ALONE_EXTRA = 0.45
# The orchestrator's API, the first time it starts on a machine, creates its database (tasks/warm.py marks
# api_store_created when it is not there): stored apart under machine_key(); never measured, this at speed 1
# (the quiet 2-core Xeon: 6.9 s, against 3.2 s for the same API's later starts). The first jobs of 22 bench
# reports on four hosts (bench/PREDICTION.md's, 2026-12-02 to 12-05) measured it at 4.6-9.8 s divided by their
# machine's speed, median 7.8; the 6.8 once set put every first job on the AMX Xeon 1.5-2.3 s under (9.6-9.9 s
# measured against 7.4-8.1 predicted, runs 49a-51).
API_CREATED = "orchestrator API, its database created"
DEFAULT_API_CREATED = 7.8
# ...of which the server's startup (its schema migrated, its registrations written, its services started), marked
# in the server's own process (tasks/api_process.py), is where it creates the database: the rest of a first start
# (API_FIRST_REST: its whole less its startup, of the same run) and a later start's startup (API_STARTUP, the
# database there) are stored apart under machine_key(). A later start never measured is that rest + a later
# startup; where no first start's startup was measured apart, less_creation's defaults. An API alone on a 2-core
# Zen 5 EPYC (2026-12-08, a new orchestrator home each, 3 runs): a first startup 5.9-6.4 s, a later one 0.12-0.15
# s, the server's imports and app 3.2-4.3 s in either. A first run's start runs beside its engine trials and a
# later one's beside an engine's start, so the rest of the first is not the later one's exactly: it is the part
# measured in the same process, where the defaults' difference put the first warm job after a first run 2.2 s
# under (bench/PREDICTION.md 2026-12-07: 7.1 s against 9.3). Never measured, a later startup this at speed 1.
API_FIRST_REST = "orchestrator API, its first start but its startup"
API_STARTUP = "orchestrator API, its startup, the database there"
DEFAULT_API_STARTUP = 0.1
# A run of a generation job whose corpus's answers nothing here measured generates a few of its rows first
# (tokenmill.answer_probe), on the main thread before it predicts: measured, never stored.
ANSWER_PROBE = "the answers' probe"
OVERHEAD = "shard overhead per 1,000 rows"
# ...which grows with the text each row is read and tokenized from, not with the tokens truncation keeps of it:
# stored per length class beside the runs' characters a row (their samples'), and scaled by the job's. 1,500
# docstrings of 3,347 characters a row, truncated to 256 tokens, took 2.59 s per 1,000 rows where the bench's
# long corpus (~1,180 characters, ~255 tokens) took 0.5; `make run`'s sample corpus (518 characters, ~64 tokens)
# 0.34 s where the 2^(class) scaling of the default said 0.17 (an AMX Xeon at speed 1.16, 2026-12-05). The default,
# OVERHEAD_DEFAULT_LENGTH's, is for rows of this many characters: the corpus it was measured on.
OVERHEAD_CHARS = "characters a row"
OVERHEAD_DEFAULT_CHARS = 1100
AROUND_THE_ENGINE |= {OVERHEAD_CHARS}  # read from another engine's runs with the overhead it was stored with
# Each shard is a Prefect task: its run, state and persisted result cost about this much whatever its rows.
# Measured 0.45 s a shard on a machine whose imports took 3.8 s (bench/PREDICTION.md's runs: 0.56 s for
# 1,000 short rows in one shard, 1.6 s for 8,000 in two), so 0.24 s on the reference machine (imports then read as 2.0 s, 1.3 s of CPU) that
# machine_speed scales from. A stated figure: a run's own overhead is stored per 1,000 rows after it.
PER_SHARD_SECONDS = 0.24
# A shard the output's manifest already holds still runs its task (flows/batch.py): Prefect reads its persisted
# result back (a cache hit), and the flow rewrites the partial manifest, logs its progress and updates the progress
# artifact: a part the prediction counted as none. Measured in a run whose every shard was finished (shards_start to
# shards_done, a shard) and stored under machine_key(): any job's, on this machine. An AMX Xeon at speed ~1.1
# (2026-12-05, bench/USER_SESSION.md) measured 0.05, 0.07 and 0.08 s a shard in three such reruns: 0.06 at speed 1.
FINISHED_SHARD = "a finished shard's task"
DEFAULT_FINISHED_SHARD = 0.06
# The rows whose token lengths a job's engine seconds are read from (job_sample), by mode: more than the
# trial's 256 (embed), whose tokens missed five of the bench's corpora by -6.1% to +7.6%, in every run (a
# deterministic sample: the mixed corpus, rows of ~16 and ~256 tokens, 161,673 predicted, 150,192 computed),
# where 2,048 rows' distinct inputs missed by -3.0% to +0.1%; generation's calls are planned on theirs (a
# trial's 16 rows miss a corpus's long tail).
LENGTH_SAMPLE_ROWS = {"embed": 2048, "generate": 256}
# Per engine (and mode where they differ): start (the library's import included), exit, and tokens/s, for an
# engine never measured here. Quiet 2-core CPU (bench/PREDICTION.md's trials and runs): vLLM's start 23-37 s
# embedding MiniLM (its first on a machine the longest), 81 s generating with SmolLM2 (its import
# included); MiniLM embeds at 6,500-7,900 tokens/s on either engine; SmolLM2 generates at 650-840 tokens/s
# on vLLM (later runs: below), 150-190 on transformers; exit: vLLM's shutdown 3.2-4.0 s, transformers' 0.6-1.4 s.
# vLLM's starts here are starts that load graphs an earlier start compiled (DEFAULT_VLLM_COMPILE: a first's).
# ONNX Runtime and OpenVINO load an exported model in a session, no torch import: bench/PREDICTION.md's gated
# jobs measured onnxruntime's start at 0.2 s and its exit at 1.3-1.4 s on a machine of speed ~2, and
# `make run`'s log shows OpenVINO's start within 1.1 s of its sample's read there; the EPYC's first gated runs
# (bench/PREDICTION.md runs 24a-26b, speed 0.84-0.98) measured it at 0.2-0.3 s, where 0.5 read 0.45: 0.3.
# vLLM's embedding start: 23-37 s on the quiet CPU, 58.7 and 62.2 s on a host of speed 2.22 and 2.74 (26 and 23 s
# at speed 1): 35 s put the first job on a machine 15-30% over in every bench run since run 6. A 2-core Xeon
# (speed 1.0-1.1, 2026-11-26, python -m bench.vllm_starts) loading kept graphs: 28.8-30.6 s for MiniLM, 70.7-77.2 s
# for SmolLM2 (the AMD hosts' 81 s at speed 1). Those starts ran vLLM's AOT compile, whose artifact a CPU start
# cannot load (tokenmill.vllm_engine.keep_compiles_loadable): each compiled the model again. With it off, a
# 2-core Xeon with AMX at speed ~1.14 (2026-12-05, bench/VLLM_STARTS.md) loads MiniLM in 28.5-31.9 s (33.8-36.5
# with AOT compile) and SmolLM2 in 66.8-68.9 s (98.7 s with AOT compile, 38 s of it compiling again): 26 and 57
# at speed 1 (SmolLM2's 76 less the ~26 s its starts spent compiling again, this host's 59).
DEFAULT_ENGINE_START = {("vllm", "embed"): 26.0, ("vllm", "generate"): 57.0, ("onnxruntime", "embed"): 0.1,
                        ("openvino", "embed"): 0.3}
# ONNX Runtime's and OpenVINO's exit is first measured by a gated job's rerun with its verdict kept (a measuring
# gate's exit is GATE_EXIT's): on the 2-core EPYC with AVX-512 (bench/PREDICTION.md runs 37a-38a, speed 1.00-1.29)
# 1.3, 1.2, 1.4 (onnxruntime) and 1.3 s, where 0.7 (x speed) put each of those jobs 0.4-0.6 s under, 3-5% of its
# wall: 0.9-1.3 s at speed 1, 1.2. Where the gate measured first (its run's exit, GATE_EXIT, under the same
# engine's key), that measurement stands for the engine's exit instead (exit_part): on the reruns with the verdict
# kept in bench/PREDICTION.md's 10 reports 617909d-5339705 (OpenVINO and ONNX Runtime, speed 1.0-2.7) this default
# read 1.2-3.2 s against 0.7-2.0 measured (over in 9 of 10, mean |error| 0.9 s), the gate run's exit before each
# 0.9-2.0 s (mean |error| 0.4 s): an engine's close beside the gate's models' is nearer its close alone than a
# default scaled by speed.
DEFAULT_ENGINE_EXIT = {"vllm": 3.5, "transformers": 1.0, "onnxruntime": 1.2, "openvino": 1.2}
# Closing an engine within the trials (the last one tried, which lost): vLLM's client waits out its engine core's
# shutdown (its log: "[shutdown] MPClient: start timeout=2.0s", engine manager stopped 2 s later), not a process's
# whole exit. Two users' first runs on the EPYC (session 27, speeds 0.81 and 1.02) measured the trials' seconds
# besides the engines, vLLM's close among them, at 2.7 s both, where 1 s + its exit's 3.5 put them at 3.7 and 4.6.
DEFAULT_TRIAL_CLOSE = {"vllm": 1.7}
# vLLM's first start of a model on a machine compiles it (torch.compile; the graphs kept in VLLM_CACHE_ROOT for every
# later start): seconds at machine speed 1, beyond the start above (which loads kept graphs). The 2-core Xeon at
# speed 1.0-1.1, each start a fresh process, vLLM's and torch's caches emptied before the first (three sequences,
# bench/VLLM_STARTS.md the last): MiniLM 46.5-49.8 s compiling against 28.8-30.6 s loading, SmolLM2 93.2-98.0 s
# against 70.7-77.2 s (tokenmill.vllm_engine saw each first start add a compiled graph, the later ones none).
# The 2-core EPYC's first MiniLM starts (session 27: the bench's first job and three users' first runs, each in the
# engine trials), over the machine's speed: 37.9, 42.5, 44.0 and 45.3 s, where 27 + 18 put one 18% over: 16.5.
# A later 2-core EPYC with AVX-512 (bench/PREDICTION.md runs 33b and 34a, the bench's first job each, in its
# trials): 74.8-78.6 s at speeds 1.61-1.66, 45-49 s at speed 1, where 27 + 16.5 put both 4-9% under, as it put
# the Xeon's 46.5-49.8: 18, the three hosts' middle. A 2-core Xeon with AMX (2026-12-05, speed ~1.14): MiniLM's
# first start 59.8-65.7 s (52-58 at speed 1), SmolLM2's 116.1-123.1 s (102-108), AOT compile on or off. With
# the loads above no longer compiling again (keep_compiles_loadable), a first start is the load and the compile
# that a later start no longer repeats: over the four hosts' first starts (MiniLM 45-58 s at speed 1, SmolLM2
# 93-108), 50 and 100 less the loads.
DEFAULT_VLLM_COMPILE = {"embed": 24.0, "generate": 43.0}
COMPILING_START = "engine start, compiling"  # a run's vLLM start that compiled: see first_compile
# vLLM's CPU backend embeds MiniLM at 0.44-0.47 of transformers' rate at every row length: 2,126-2,620 tokens/s
# against 4,794-5,588 on rows of 15, 52, 101 and 223 tokens (2-core AMD EPYC, AVX2, 2026-11-26, one engine each,
# best of two passes). Not a per-request cost: its rate is as flat over length as transformers'. Held to
# transformers' 7,000, the first job on a machine that ran on vLLM was predicted at twice its measured rate.
# vLLM generating SmolLM2 (rows of ~85 tokens, 32 out): 453-472 tokens/s at machine speed 1 on a 2-core Xeon
# (467-487 at 0.97), 513 on a 2-core AMD EPYC (270 at 1.9), 2026-11-26; 700 had put both 1.4-1.5x fast.
DEFAULT_TOKENS_PER_S = {("vllm", "generate"): 490.0, ("transformers", "generate"): 170.0,
                        ("vllm", "embed"): 3_200.0}
DEFAULT_TOKENS_PER_S_BY_MODE = {"embed": 7_000.0, "generate": 170.0}
# The float32 matrix-product rate (GFLOP/s, a core's times the cores: tokenmill.device.core_gflops) of a machine
# the default tokens/s above hold on, for a CPU no run has measured where no command could run the model probe (a
# library call, or no torch here: probe_speed). Measured on a 2-core Xeon with
# AVX-512 (2026-11-26): its cores probed at 163-171 GFLOP/s each, and its first runs computed at 1/0.67-1/0.69 of
# the defaults (MiniLM: transformers 10,127 tokens/s, vLLM 4,430-4,792, at ~20 tokens a row): 0.68 x 2 x 168 = 228.
# Not probed on the 2-core AVX2 AMD hosts most defaults came from (runs there computed at 1/1.4-1/1.6 of them): at
# 85% of their cores' peak (two 8-wide FMA units at 2.5-3.0 GHz) they would probe at 68-82 GFLOP/s a core, which
# this figure puts at 1/1.4-1/1.65. A stated estimate until a session on such a host probes one.
DEFAULT_GFLOPS = 228.0
# An embedding model's default rate by engine, quantization (None: float32) and CPU class, as a multiple of its
# engine's (transformers' float32 for OpenVINO's float32, measured in the same runs). A CPU with AVX2 and no VNNI
# (bench/PREDICTION.md's host, machine speed ~2.2) measured MiniLM on 256-row gate samples at 6,760-7,520 tokens/s
# with ONNX Runtime's dynamic int8, 3,540-3,700 with OpenVINO's static int8 (slower than its float32's 4,400-4,440:
# without VNNI its int8 products are emulated), transformers' float32 4,400-4,700. With VNNI and no AMX (a 2-core
# AMD EPYC with AVX-512 VNNI, 2026-11-28, bench/PREDICTION.md run 22a; runs there computed at 1/0.89 of the
# defaults, transformers' float32 at 7,700-7,930 tokens/s): ONNX Runtime's dynamic int8 at 25,500-28,200 on the
# gate's 256-row samples (3.2-3.6x), OpenVINO's static int8 at 27,900-36,000 over the mixed corpus's lengths and
# 36,400-44,000 in whole runs (4.7-5.6x; its float32 at 14,600-16,500). With AMX's int8 tiles (a 2-core Xeon,
# 2026-11-26: whole runs of the 3,000-row mixed corpus, two rounds interleaved): transformers' float32
# 10,075-10,145 tokens/s, OpenVINO's float32 11,065-11,102, ONNX Runtime's dynamic int8 18,025-18,167 (1.8x),
# OpenVINO's static int8 29,944-30,515 (3.0x).
# The EPYC's whole runs since (run 23d, the bench's gated jobs): OpenVINO's int8 at 40,900-44,300 tokens/s on rows
# of 32-125 tokens and 36,100-39,700 at 236-255, transformers' float32 at 7,600-8,150: 4.5-5.8x, so 5.0 (4.5 put a
# first gated run's engine 10-15% over; a gate's 256-row sample costs its calls' overhead besides: GATE_BESIDES).
# OpenVINO's float32 ran at 1.0x transformers' (on MKL) without VNNI, 2.0x on the EPYC, 1.1x with AMX: a gate's reference on
# it is a model every first gate measures at its default, and the EPYC's first gate (run 23a) put its 256-row sample
# at 1.7 s at 1.0x where it took ~0.9.
# vLLM's float32 embedding ran at 0.44-0.47x transformers' on the AVX2 host and with AMX (its default, 3,200, is
# theirs), and at 0.95-1.08x on the EPYC (trials of 6,450-8,051 tokens/s at 19-255 tokens a row, runs 7,381-8,056;
# transformers' 7,018-7,812 in the same runs, bench/PREDICTION.md runs 22a-23d): 2.1x. At 1.0x every first job there
# put vLLM's trial and engine at 2.3x their seconds.
# The transformers engine's own float32 since its linear layers run on oneDNN, not MKL (tokenmill.hf_engine): on
# the EPYC, whole runs of MiniLM at 11,660-12,540 tokens/s (bench/PREDICTION.md run 26a; the others' figures above
# are from MKL's runs there, at 7,600-8,150), where its default put the machine's compute at 1/0.6 of the defaults
# and OpenVINO's first gated run at 1.5 s of engine against 2.2: 1.5. Two users' first runs there (session 27, 6,000
# and 20,000 short rows, auto choosing transformers) ran at 12,829 and 12,323 tokens/s with the machine's compute at
# 0.88 and 0.95, 1.61x and 1.67x, where 1.5 put the second's engine at 38.5 s against 34.4; its rerun and the bench's
# 8,000 short rows (run 27a) at 1.69x and 1.66x: 1.65. On oneDNN with AMX (a 2-core Xeon, 2026-11-29, runs 29a-b,
# its cores probing 171-181 GFLOP/s a core: 1/0.63-1/0.67 of the defaults' machine): whole runs at 8,640-9,550
# tokens/s, 0.78-0.91x its default at that compute (MKL's there, session 26: 10,075-10,145), where vLLM's trials ran
# at 4,250-5,550 by length, about its default's: transformers' runs put the machine at 1/0.8, vLLM's at 1/0.6-1/0.7:
# 0.85. OpenVINO's int8 there: 33,000-37,000 tokens/s in whole gated runs and `make run` (its 3.0 put a first gate's
# engine at 3.1 s against 2.4), 3.1-3.5x at the probe's compute: 3.3. Once runs here measured the transformers engine,
# the machine's compute is theirs (compute_speed), so OpenVINO's int8 is priced against transformers' measured rate:
# the bench's first gated runs there (bench/PREDICTION.md runs 30a-32c, the mixed corpus) ran it at 3.0-3.6x the
# transformers engine's rate on the same corpus in the same run (median 3.4), where 3.3 / 0.85 put it at 3.9x and
# their engine 0.1-0.7 s under in all six (2.6-3.3 s predicted, 2.7-3.7 measured): 3.4 x 0.85 = 2.9.
# On oneDNN with AVX2 alone (a 2-core AMD EPYC of Zen 3, no AVX-512, no VNNI, 2026-12-02/03, bench/PREDICTION.md
# runs 39a-b): the transformers engine at 4,490-5,430 tokens/s, ONNX Runtime's dynamic int8 at 9,384-10,044 in whole
# gated runs (2.1x, 1.9x) and 9,543-9,993 on `make run`'s 256-row gate sample against transformers' 5,301 there
# (1.8-1.9x), where 1.6 (MKL's era above) put both first gates' engine 2-3 s over (+19%, +22.5% in all); on that
# sample OpenVINO's float32 at 6,412-6,530 (1.2x) and its static int8 at 5,826 (1.1x): 1.9, 1.2 and 1.1.
DEFAULT_SPEEDUP = {("onnxruntime", "int8", "no-vnni"): 1.9, ("openvino", "int8", "no-vnni"): 1.1,
                   ("openvino", None, "no-vnni"): 1.2,
                   ("onnxruntime", "int8", "vnni"): 3.4, ("openvino", "int8", "vnni"): 5.0,
                   ("onnxruntime", "int8", "amx"): 1.8, ("openvino", "int8", "amx"): 2.9,
                   ("openvino", None, "vnni"): 2.0, ("openvino", None, "amx"): 1.1, ("vllm", None, "vnni"): 2.1,
                   ("transformers", None, "vnni"): 1.65, ("transformers", None, "amx"): 0.85}
# Generation's by engine and CPU class, as a multiple of its default tokens/s (prompts' and answers' tokens). vLLM
# generating SmolLM2 on the EPYC of VNNI's class (2026-11-28, imports' speed 0.85-0.95): whole runs at 746-845
# tokens/s on 47-96 rows of 83-305 prompt tokens and 17-56 answer tokens (bench/PREDICTION.md runs 23-24's first
# generation, and two user jobs on Python functions' source), where its 490 at speed 1 put them at 518-575: the
# engine 1.4-1.6x over (64.1 s against 39.4 in one), its first job +13.6%. Its trials (12-16 rows a call) ran at
# 613-682. 1.4. The transformers engine on oneDNN there (run 26a): SmolLM2 at 333 tokens/s on 48 rows at a cap of
# 32, 244-271 on 96 at 64 (on MKL: 156-184), 1/0.5-1/0.7 of its default where vLLM's ran at 1/0.9: 1.5.
DEFAULT_GENERATE_SPEEDUP = {("vllm", "vnni"): 1.4, ("transformers", "vnni"): 1.5}
MEASURED_QUANTIZED = {("onnxruntime", "int8", "no-vnni"), ("openvino", "int8", "no-vnni"),
                      ("onnxruntime", "int8", "vnni"), ("openvino", "int8", "vnni"),
                      ("onnxruntime", "int8", "amx"), ("openvino", "int8", "amx")}
LOCAL_ENGINES = ("vllm", "transformers", "onnxruntime", "openvino")  # the engines that compute on this machine
DEFAULT_WINNER = {"embed": "transformers", "generate": "vllm"}  # auto's usual choice on a CPU, without trials
DISTINCT_ROWS_READ = 1_000_000  # rows read to count identical inputs; beyond them, the share counted so far
KEEP_LAST = 5
# An eval gate never measured here: each model's start and the sample at its rate (the engines' defaults), and
# this for the rest (the sample's reading, the metrics, closing an engine). A gate whose verdict this machine
# kept starts no engine: it reads the sample and judges it again, two tasks of the job's own flow (0.07-0.09 s
# on a quiet 2-core Xeon; 1.1-3.3 s there while the gate was a subflow: flows/gate.py run_gate). The rest measured
# 1.4-1.7 s in the bench's first gates on the 2-core EPYC (runs 27-28, speed 0.93-0.95) and 1.6-1.7 on a 2-core
# Xeon with AMX (runs 29a-d, 1.05), where 1.0 put them 0.6 s under (-9% and -10% on the 13-second job): 1.6.
GATE_BESIDES_SECONDS = 1.6
GATE_VERDICT_KEPT_SECONDS = 0.1
GATE_MEASURED, GATE_KEPT, GATE_BESIDES = "gate", "gate, verdict kept", "gate besides the models' samples"
MEASURED_RATE = "tokens/s measured"  # per mode, quantization and engine, under machine_key(): see compute_speed
PROBE = "float32 GFLOP/s a core"  # under machine_key(): see probe_speed
MODEL_PROBE = "MiniLM-shaped float32 tokens/s a core"  # under machine_key(): see probe_speed
MODEL_PROBE_PART = "the machine's model probe"  # a first command's, on the main thread before it predicts: measured
# `tokenmill run`'s, before Prefect's API starts (probe_machine): its seconds, then the API's start and the rest
MODEL_PROBE_BEFORE_API = f"{MODEL_PROBE_PART} first"  # reads "the machine's model probe first 3.0 s, ...; then API ..."
# the demo's sample corpus, written before the API starts where the run's gate reads it first (tokenmill.gate.judge_first)
SAMPLE_WRITTEN_BEFORE_API = "writing the sample corpus first"
BEFORE_API = (MODEL_PROBE_BEFORE_API, SAMPLE_WRITTEN_BEFORE_API)  # main_thread_parts' parts before the API starts
# The transformers engine's float32 MiniLM tokens/s in whole runs over the model probe's tokens/s a core times
# the cores (tokenmill.device.model_tokens_per_s), on a CPU no run has measured. On a 2-core AMD EPYC with AVX-512
# VNNI (2026-12-02) the probe read 2,670-3,350 tokens/s a core (median ~2,950) and the engine's whole runs of the
# bench's corpora 5,040-6,730 tokens/s (bench/PREDICTION.md runs 33a-b, median ~6,000): 1.0. Its numpy products
# there (core_gflops: 92-101 GFLOP/s a core, 1/1.16 of DEFAULT_GFLOPS) put the engine at ~9,950 tokens/s with the
# class's speedup, and `make run`'s first OpenVINO int8 corpus at 84.9 s of engine against 54.7.
MODEL_PROBE_SCALE = 1.0
INTERPRETER = "interpreter probe, ms"  # under machine_key(): see machine_speed
IMPORTS = "a command's imports, s"  # under machine_key(): see machine_speed
# The interpreter probe's milliseconds (tokenmill.device.interpreter_ms) on the defaults' machine. Set so that the
# 2-core EPYC of bench/PREDICTION.md's runs 22-27, on which the defaults were last measured, reads the speed its
# first runs read by the figure before this one (the first command's imports' user CPU seconds: 1.21-1.27 s in
# runs 26c-27b against the quiet Xeon's 1.3, 0.93-0.97), where the probe reads 9.8-10.8 ms (median 10.2; run
# 28a, with 11.4 here, put both first jobs 9-11% under: their fixed seconds at 0.89).
DEFAULT_INTERPRETER_MS = 10.7
# A shard overhead is scaled from a measured length class at most this many classes (x2 each) away: part of
# it is per row, not per token, and a factor of 4 is as far as the runs here bear it out.
MAX_LENGTH_CLASSES_SCALED = 2


def default_exit(engine: str) -> float:
    """An engine's closing seconds never measured here (an engine of neither kind: 2 s, stated)."""
    return DEFAULT_ENGINE_EXIT.get(engine, 2.0)


class Part(BaseModel):
    name: str
    seconds: float
    source: str  # how it was measured, or "default: never measured here"

    @property
    def is_default(self) -> bool:
        return "default:" in self.source  # "default: never measured here, ...", maybe after a per-rows rate


class Prediction(BaseModel):
    engine: str
    rows: int  # rows the engine computes
    tokens: float  # input + output tokens the engine computes
    parts: list[Part]
    read_tokens: int = 0  # the tokens its sample read (JobSample.read_tokens)
    read_chars: int = 0  # and their characters (JobSample.read_chars): what its reading part grows with
    chars_per_row: float = 0.0  # the corpus sample's characters a row (JobSample.chars_per_row): its overhead's
    # a gate that measures before the corpus runs: the whole process's seconds and its exit part's were the corpus
    # to run on each model the gate may pick (branch_key), from the same figures; the prediction is the one
    # it assumes (predict_gated). Which model ran is the gate's verdict, measured, not a time: the record holds
    # the branch that ran beside the prediction (compare), the prediction's error left as it is.
    branches: dict[str, tuple[str, float, float]] = {}
    assumed: str = ""  # the branch this prediction is (branch_key), where it has branches
    track: str = ""  # how this machine's last runs came out against their predictions (track_record)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts)

    @property
    def engine_seconds(self) -> float:
        return sum(p.seconds for p in self.parts if p.name == "engine")

    @property
    def fixed_seconds(self) -> float:
        return self.seconds - self.engine_seconds

    def part(self, name: str) -> Part | None:
        return next((p for p in self.parts if p.name == name), None)

    def describe(self) -> str:
        parts = "; ".join(f"{p.name} {p.seconds:,.1f} s ({p.source})" for p in self.parts if p.seconds or p.is_default)
        return (f"predicted wall {self.seconds:,.0f} s on {self.engine}: {self.fixed_seconds:,.0f} s fixed + "
                f"{self.engine_seconds:,.0f} s engine for {self.rows:,} rows, {self.tokens:,.0f} tokens [{parts}]"
                + (f"\n{self.track}" if self.track else ""))

    def metrics(self) -> dict[str, float]:
        return {"predicted_wall_seconds": self.seconds, "predicted_engine_seconds": self.engine_seconds,
                "predicted_fixed_seconds": self.fixed_seconds, "predicted_tokens": self.tokens,
                "predicted_exit_seconds": getattr(self.part("exit"), "seconds", 0.0),
                "predicted_default_parts": float(sum(p.is_default for p in self.parts))}


class JobSample(BaseModel):
    """What the engine will compute: rows and shards still to run, and the sample's token lengths.
    rows: the rows of the shards still to run less the row cache's share; distinct: the share of them
    left once identical inputs are computed once (1.0: not counted); rows_read: every row of those shards."""
    rows: int
    shards: int
    lengths: list[int]  # the corpus's sample (LENGTH_SAMPLE_ROWS): its tokens, the job's calls planned on
    distinct_lengths: list[int] = []  # the sample's distinct inputs': what a run that collapses them computes
    trial_lengths: list[int] = []  # the engine trial's sample, as the trial computes it (trials_part)
    row_cache_share: float = 0.0
    finished_shards: int = 0
    distinct: float = 1.0
    distinct_source: str = ""
    rows_read: int = 0
    gate_kept: int = 0  # a gated embedding job: the gate's sample rows it computes and keeps in the row cache
    probe_kept: int = 0  # a run's answers' probe: the rows it generated, kept in the row cache (answer_probe)
    probe_engine: str = ""  # the engine it ran on: its rows are kept under it, and auto's trials reuse it, open
    read_tokens: int = 0  # the tokens of the rows read for this sample (both samples')
    read_chars: int = 0  # the characters of those rows: what READING grows with (text_chars)
    chars_per_row: float = 0.0  # the length sample's mean characters a row: what the shard overhead grows with

    def computed_lengths(self, collapsed: bool) -> list[int]:
        """The lengths of the rows the engine computes: each input once where identical inputs are computed
        once (the bench's mixed corpus repeats short rows: every sampled row's mean put 5.3% fewer tokens on
        it than the engine computed, the distinct inputs' 3.0%)."""
        return (self.distinct_lengths or self.lengths) if collapsed else self.lengths

    def rows_to_compute(self, collapsed: bool) -> int:
        return max(round(self.rows * (self.distinct if collapsed else 1.0)) - self.gate_kept - self.probe_kept, 0)


# ---- the parts cache -------------------------------------------------------------------------------

def _parts_path() -> Path:
    return cache_dir() / "run-parts.json"


def read_parts() -> dict[str, Any]:
    return read_json(_parts_path())


def remember_parts(measured: dict[str, dict[str, float]], keep: int = KEEP_LAST) -> None:
    """Measured seconds by (key, part name): appended to each part's last `keep` measurements."""
    if not measured:
        return
    def append(stored: dict[str, Any]) -> None:
        for key, parts in measured.items():
            entry = stored.setdefault(key, {})
            for name, seconds in parts.items():
                entry[name] = (entry.get(name, []) + [round(max(seconds, 0.0), 3)])[-keep:]
            entry["_measured_at"] = [time.time()]

    rewrite_json(_parts_path(), append, indent=1)


def fixed_key(spec: JobSpec, engine: str) -> str:
    return f"{device_label()}|{engine}|{spec.mode}"


def engine_key(spec: JobSpec, engine: str) -> str:
    return f"{device_label()}|{engine}|{spec.model_name}|{spec.mode}"


def gate_key(spec: JobSpec) -> str:
    """An eval gate's seconds: per device and mode, for its models (reference and candidates) and sample size, and
    what the gate measures (GATE_CACHE_VERSION: a gate of another version ran other passes of its sample)."""
    models = [spec.gate.reference.model_dump(mode="json"), *(m.model_dump(mode="json") for m in candidate_models(spec))]
    digest = stable_digest([models, spec.gate.sample_rows, GATE_CACHE_VERSION], 12)
    return f"{device_label()}|gate|{spec.mode}|{digest}"


def trials_key(spec: JobSpec) -> str:
    return f"{device_label()}|trials|{spec.model_name}|{spec.mode}"


def rate_points(spec: JobSpec, engine: str, parts: dict[str, Any], trials,
                gate_rate: tuple[float, float, str] | None = None) -> list[tuple[float, float, str]]:
    """(mean input tokens a row, tokens/s, where from): what runs of this job's family measured here at a
    length class, else an eval gate's sample on this model (gate_rate: mean tokens a row, tokens/s, where),
    else its trial there."""
    runs = parts.get(rates_key(spec, engine), {})
    points = {int(name.split("@")[1]): (statistics.median(runs[f"mean_tokens@{name.split('@')[1]}"]),
                                        statistics.median(values), "runs")
              for name, values in runs.items() if name.startswith("tokens_per_s@")}
    if gate_rate is not None:
        points.setdefault(length_class(gate_rate[0]), gate_rate)
    for mean, t in trials:
        if t.engine == engine and t.tokens_per_s > 0:
            points.setdefault(length_class(mean), (mean, t.tokens_per_s, "trial"))
    return sorted(points.values())


def machine_speed() -> tuple[float, str]:
    """How much slower than the machine the defaults were measured on this one is, by a probe of the
    interpreter's pace (tokenmill.device.interpreter_ms: a module's body compiled, run and called, the fastest
    of 7 rounds; a command's, the fastest of up to 3 such readings 1.5 s apart: command_interpreter_ms) against
    the defaults' machine's (DEFAULT_INTERPRETER_MS). The first command that predicts on this
    device stores its figure under machine_key(), and every run adds its own (measured_parts): the lower quartile of
    the last KEEP_LAST (interpreter_speed). Only a run changes it, as it changes every measured part, so plan,
    calibrate and run of one job scale their defaults alike. It scales every default: seconds up, tokens/s down (two
    2-core CPUs of one type here took 1.8-1.9 s and 3.3-4.8 s for a command's imports, and their engine starts and
    rates differed by about as much). Not the imports' CPU seconds any more: on one 2-core
    EPYC they read 1.33-1.35 s in three rounds of user jobs and 1.06-1.08 s in two later ones (a process's
    CPU counts its thread pools' spinning, which a busy neighbour cuts), scaling every default of a first
    run by 20% while vLLM's first starts there took 37.7-43.4 s in all of them (bench/PREDICTION.md run 27).
    With it, a command's imports' wall seconds (command_imports_seconds, stored alike): the geometric mean of
    the two. The defaults it scales are starts (vLLM's, transformers', Prefect's API creating its database),
    which read files and import as much as they compute, and a shared host's slow hours slow those more than
    the probe's pure interpreter work: on the 2-core Xeon (bench/PREDICTION.md runs 29a-31c, ten first jobs)
    the first job's imports took 1.2-1.6 s in quiet runs and 2.3 and 3.1 s in the two whose first jobs missed
    by -18% and -33%, where the probe read 13.3 and 13.6 ms against 10.8-12.3; over those ten runs vLLM's first
    MiniLM and SmolLM2 starts, the API's first start and transformers' start missed a figure at speed 1 times
    the probe's factor by 12-17% rms, times the imports' by 8-13%, times the two's geometric mean by 3-8%.
    1.0 before any command measured either (a library call does not start at a command)."""
    found = [speed for speed in (interpreter_speed(), imports_speed()) if speed is not None]
    if not found:
        return 1.0, ""
    if len(found) == 1:
        factor, why = found[0]
    else:
        (by_probe, probe_said), (by_imports, imports_said) = found
        factor = math.sqrt(by_probe * by_imports)
        why = f"the geometric mean of {by_probe:.2f} ({probe_said}) and {by_imports:.2f} ({imports_said})"
    return factor, f" x {factor:.2f} (this machine's speed: {why})"


def speed_by_interpreter() -> tuple[float, str]:
    """The interpreter probe's factor alone, and what it is from ("" where nothing measured it)."""
    found = interpreter_speed()
    return (found[0], f"this machine's speed: {found[1]}") if found else (1.0, "")


def interpreter_speed() -> tuple[float, str] | None:
    """The interpreter probe's factor, from the lower quartile of the commands' last probes here (lower_quartile),
    not their median: what slows the probe (a neighbour's work on a shared host) only slows it, and the starts
    it scales did not follow: on a 2-core EPYC (bench/PREDICTION.md runs 33a-b) it read 14.3-26.2 ms within
    one bench while vLLM's first SmolLM2 starts held within 4% (133.1 and 138.0 s), and the median of five
    at 22.9 ms put the second at 180.5 s (its job +25.2%) where the lower quartile's 15.9 ms put it at ~150."""
    return stored_speed(INTERPRETER, command_interpreter_ms, DEFAULT_INTERPRETER_MS, "ms",
                        "commands' interpreter probes", "the interpreter probe", low=True)


def imports_speed() -> tuple[float, str] | None:
    return stored_speed(IMPORTS, command_imports_seconds, DEFAULT_SECONDS["python imports"], "s",
                        "commands' imports", "a command's imports")


def stored_speed(name: str, measure: Callable[[], float | None], reference: float, unit: str, many: str,
                 one: str, low: bool = False) -> tuple[float, str] | None:
    """A machine figure (machine_figure: the median of the commands' last KEEP_LAST here, or with `low` their
    lower quartile) over the defaults' machine's, bounded to 0.5-4, and what it is from; None where nothing
    measured it."""
    measured = machine_figure(name, measure)
    if not measured:
        return None
    value = lower_quartile(measured) if low else statistics.median(measured)
    said = (f"the {'lower quartile' if low else 'median'} of {len(measured)} {many} here" if len(measured) > 1
            else f"{one} here")
    return (min(max(value / reference, 0.5), 4.0),
            f"{said}, {value:.1f} {unit}, against {reference:g} {unit}")


def lower_quartile(values: list[float]) -> float:
    """The lower quartile of a few figures, as one of them: the second lowest of 5, the lowest of 2-4."""
    return sorted(values)[(len(values) - 1) // 4]


def machine_figure(name: str, measure: Callable[[], float | None]) -> list[float]:
    """A figure of this machine's as stored under machine_key() (the last KEEP_LAST). Where none is stored yet,
    the first command that asks measures and stores it, so every later command reads the figure it read;
    empty where it cannot be measured here (measure gives None)."""
    key = machine_key()
    measured = read_parts().get(key, {}).get(name) or []
    if not measured:
        value = measure()
        if value is None:
            return []
        remember_parts({key: {name: value}})
        measured = [value]
    return measured


def machine_key() -> str:
    return f"{device_label()}|machine"


def command_interpreter_ms() -> float | None:
    """The interpreter probe's milliseconds, measured once a process, where the process is a command's (it
    marked command_ready: tokenmill.cli) and this is its first job; None elsewhere or where the probe fails.
    The fastest of the readings the command started as it was ready (tokenmill.device.InterpreterProbes: up to
    3, 1.5 s apart; a first command asks after its model probe or answers' probe, seconds in, a later one at its
    record), else one probe now (main() called without them: a test's)."""
    if not timeline.measures_process() or "command_ready" not in timeline.marks():
        return None
    global _interpreter_probed
    if _interpreter_probed is None:
        try:
            probes = take_interpreter_probes()
            probed = probes.best() if probes is not None else interpreter_ms()
            _interpreter_probed = round(probed or 0.0, 2)  # as stored: later commands read what this one read
        except Exception:  # noqa: BLE001 - a probe that cannot run leaves the defaults as stated
            _interpreter_probed = 0.0
    return _interpreter_probed or None


_interpreter_probed: float | None = None


def start_command_probes(records: bool) -> None:
    """Start the interpreter probes of a command that reads them (tokenmill.cli, as the command is ready:
    tokenmill.device.InterpreterProbes): a run's record stores its figure, so a run's always; a plan's or a
    calibration's prediction reads it only where none is stored here yet, so theirs then alone (else they would
    run beside its engine trials or its sweep for nothing)."""
    if _interpreter_probed is not None:
        return
    if not records and read_parts().get(machine_key(), {}).get(INTERPRETER):
        return
    start_interpreter_probes()


def command_imports_seconds() -> float | None:
    """A command's imports' wall seconds: its process's start to command_ready (tokenmill.cli: Python's start,
    Prefect's and pydantic's imports, the parser), where the process was started as the command (cli.command
    marked command_process: not main() called in a notebook's or a test's long-lived process, whose start is
    not the command's) and this is its first job (machine_speed); None elsewhere."""
    marks = timeline.marks()
    if not timeline.measures_process() or not {"command_process", "command_ready"} <= set(marks):
        return None
    return round(max(marks["command_ready"] - timeline.process_started(), 0.01), 2)


def default_start_here(engine: str, mode: str) -> float:
    return default_start(engine, mode) * machine_speed()[0]


def default_rate_here(engine: str, mode: str, quantization: str | None = None) -> float:
    return default_rate(engine, mode, quantization) / compute_speed(mode, quantization)[0]


def int8_class() -> str:
    """The class of int8 products this CPU runs, for the quantized defaults: int8_isa ('vnni', 'no-vnni'),
    with AMX's int8 tiles told apart from VNNI alone (they ran OpenVINO's int8 at 3x float32)."""
    isa = int8_isa()
    return "amx" if isa == "vnni" and "amx_int8" in cpu_flags() else isa


def measured_default(engine: str, mode: str, quantization: str | None) -> bool:
    """Whether an engine's default rate is a measured figure a run here can be held to (compute_speed): not an
    OpenAI-compatible server's (it computes elsewhere), nor a quantization's never measured (a guess)."""
    if engine not in LOCAL_ENGINES:
        return False
    if not quantization:
        return True
    return (engine, quantization, int8_class()) in MEASURED_QUANTIZED


def compute_key(mode: str, quantization: str | None, engine: str) -> str:
    """Where runs of this mode store the tokens/s they measured on an engine (compute_speed): a quantized model's
    apart. A quantized default is a float32 one times a guess at this CPU's int8 speedup (DEFAULT_SPEEDUP), which a
    run measures as much as the machine: on a 2-core Xeon with AMX, `make run`'s OpenVINO int8 ran at 1/0.58 of its
    default and the float32 transformers engine at 1/0.7-1/0.8 of its own, and a user's first corpus after
    `make run`, divided by the int8 run's figure, was put at 31.8 s of engine against 41.8 (bench/PREDICTION.md,
    run 29's user rounds)."""
    return f"{MEASURED_RATE}@{mode}" + (f"@{quantization}" if quantization else "") + f"@{engine}"


def measured_factors(stored: dict[str, Any], mode: str, quantization: str | None) -> list[float]:
    """Each run's default rate over the rate it measured (compute_key's), against today's defaults: a stored
    factor would keep the default it was taken against, and a default changed since would scale every later
    prediction by the change (a cache of runs before run 29's AMX default put `make run` 16.6% over)."""
    prefix = compute_key(mode, quantization, "")
    return [default_rate(name[len(prefix):], mode, quantization) / rate
            for name, rates in sorted(stored.items()) if name.startswith(prefix) and "@" not in name[len(prefix):]
            for rate in rates if rate > 0]


def compute_speed(mode: str, quantization: str | None = None) -> tuple[float, str]:
    """How much slower than their defaults engines compute on this machine: the median, over the last runs
    here of this mode (each engine's last KEEP_LAST, any job), of an engine's default rate over the rate the run
    measured (measured_factors); for a quantized model, over runs of that quantization, else float32's
    (compute_key), never a float32 one by quantized runs.
    Before any run, embedding on a CPU: probe_speed, a MiniLM-shaped encoder probed by the first command here
    (else its cores' matrix products against the defaults' machine's). Not the interpreter's figure
    (machine_speed), which does not read the vector units: a 2-core AMD host whose imports took 2.2x the
    defaults' ran MiniLM at 1/1.5-1/1.6 of their rates, and a 2-core Xeon with AVX-512 whose imports took
    1.07x ran it at 1/0.67-1/0.69 of them. Generation (a few rows a
    step, small products: the interpreter's and the memory's pace, not the vector units') by the
    interpreter's figure: that Xeon generated at 1/1.44-1/1.50 of the defaults, the AMD host at 1/2.6,
    against imports of 0.97x and 1.9x (the defaults since set from both)."""
    stored = read_parts().get(machine_key(), {})
    measured = (quantization and measured_factors(stored, mode, quantization)) or measured_factors(stored, mode, None)
    if not measured:
        probed = probe_speed() if mode == "embed" else None
        if probed is not None:
            return probed
        factor, why = speed_by_interpreter()
        return factor, f" / {factor:.2f} ({why})" if why else ""
    factor = min(max(statistics.median(measured), 0.25), 8.0)
    return factor, (f" / {factor:.2f} (this machine's compute: engines ran at 1/{factor:.2f} of their default rates, "
                    f"the median of {len(measured)} runs here)")


def probe_speed() -> tuple[float, str] | None:
    """On a CPU, before any run here measured an engine: how much slower than their defaults engines compute
    here, by a probe. A command's (the first that predicts here, on its main thread before it predicts, 2.4-3 s:
    MODEL_PROBE_PART) runs a MiniLM-shaped encoder as the transformers engine runs it (model_tokens_per_s) and
    reads the engine's float32 default over that rate times the cores (MODEL_PROBE_SCALE); every later command
    reads the figure it stored, so plan, calibrate and run of one job divide their default rates alike, and the
    other engines' defaults follow from their ratios to the transformers engine's (DEFAULT_SPEEDUP). Where no
    command has probed (a library call, or where the model probe cannot run): the defaults' machine's
    matrix-product rate over this one's (tokenmill.device.core_gflops, one core's, times the cores), stored
    alike; a command's model probe rules once stored. The products' probe read two EPYCs of one type 20-30%
    apart where their transformers engines ran 2x apart (tokenmill.device.model_tokens_per_s). None on a GPU
    (the probes read the CPU) or where neither can run."""
    if not device_label().startswith("cpu"):
        return None
    cores = usable_cores()
    modelled = machine_figure(MODEL_PROBE, command_model_probe)
    per_core = statistics.median(modelled) if modelled else 0.0  # 0: a command's probe that could not run, stored
    if per_core > 0:
        reference = default_rate("transformers", "embed")
        factor = min(max(reference / (per_core * cores * MODEL_PROBE_SCALE), 0.25), 8.0)
        return factor, (f" / {factor:.2f} (this machine's compute before any run here: a MiniLM-shaped float32 "
                        f"encoder probed at {per_core:,.0f} tokens/s a core x {cores} cores, against the "
                        f"transformers engine's default {reference:,.0f})")
    measured = machine_figure(PROBE, _probe_core)
    if not measured:
        return None
    per_core = statistics.median(measured)
    factor = min(max(DEFAULT_GFLOPS / (per_core * cores), 0.25), 8.0)
    return factor, (f" / {factor:.2f} (this machine's compute before any run here: a core's float32 matrix "
                    f"products at {per_core:,.0f} GFLOP/s x {cores} cores, against the defaults' "
                    f"{DEFAULT_GFLOPS:,.0f})")


_model_probed: float | None = None


def command_model_probe() -> float | None:
    """The model probe's tokens/s a core (model_tokens_per_s), measured once a process, where the process is a
    command's (it marked command_ready: tokenmill.cli) and this is its first job, its span marked for the
    prediction (MODEL_PROBE_PART) and the main thread's measured parts; 0.0 where it cannot run here (stored as
    such, so later commands do not try again: probe_speed falls back to the products' probe); None elsewhere."""
    if not timeline.measures_process() or "command_ready" not in timeline.marks():
        return None
    global _model_probed
    if _model_probed is None:
        timeline.mark("model_probe_start")
        _model_probed = round(model_tokens_per_s() or 0.0, 1)  # as stored: later commands read what this one read
        timeline.mark("model_probe_done")
    return _model_probed


def _probe_core() -> float | None:
    try:
        return round(core_gflops(), 1)  # as stored: the command that probed reads what later ones read
    except Exception:  # noqa: BLE001 - no BLAS to probe: the interpreter's figure stands in (compute_speed)
        return None


def stored(parts: dict[str, Any], key: str, name: str, default: float | None,
           low: bool = False) -> tuple[float | None, str]:
    """A part's seconds here (the median of its last measurements; with `low`, their lower quartile) and where
    they came from. A part of the process around the engine (AROUND_THE_ENGINE) that runs on this engine never
    measured is read from runs on another engine of this device and mode, and says so."""
    values = parts.get(key, {}).get(name)
    source = f"measured here, {of_runs(len(values or []), low)}"
    if not values and name.split("@")[0] in AROUND_THE_ENGINE:
        device, engine, mode = key.split("|")
        other = next((k for k, v in sorted(parts.items()) if v.get(name) and k.count("|") == 2
                      and k.startswith(f"{device}|") and k.endswith(f"|{mode}")), None)
        if other is not None:
            values = parts[other][name]
            source = f"measured here on {other.split('|')[1]}, {of_runs(len(values), low)}"
    if not values:
        if default is None:
            return None, "default: never measured here"
        factor, why = machine_speed()
        return default * factor, f"default: never measured here, {default:g} s{why}"
    return (lower_quartile(values) if low else statistics.median(values)), source


def of_runs(count: int, low: bool = False) -> str:
    """Which of `count` runs' figures a part reads, as stored() reads it: their median, or with `low` their
    lower quartile (of one run, its figure: its median)."""
    return f"{'lower quartile' if low and count > 1 else 'median'} of {count} run{'s' if count > 1 else ''}"


# ---- engine seconds ----------------------------------------------------------------------------------

def rate_at(points: list[tuple[float, float]], length: float) -> float:
    """tokens/s at `length` tokens a row from (mean tokens a row, tokens/s) points: log-log between
    the measured lengths, the nearest one's rate beyond them."""
    points = sorted(points)
    x = math.log(max(length, 1.0))
    logs = [(math.log(m), math.log(r)) for m, r in points]
    if x <= logs[0][0]:
        return points[0][1]
    if x >= logs[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(logs, logs[1:]):
        if x0 <= x <= x1:
            return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0 or 1.0))
    return points[-1][1]


def default_rate(engine: str, mode: str, quantization: str | None = None) -> float:
    rate = DEFAULT_TOKENS_PER_S.get((engine, mode), DEFAULT_TOKENS_PER_S_BY_MODE[mode])
    if mode == "embed":
        rate *= DEFAULT_SPEEDUP.get((engine, quantization or None, int8_class()), 1.0)
    else:
        rate *= DEFAULT_GENERATE_SPEEDUP.get((engine, int8_class()), 1.0)
    return rate


def engine_part(spec: JobSpec, engine: str, sample: JobSample, trials,
                parts: dict[str, Any] | None = None,
                gate_rate: tuple[float, float, str] | None = None) -> tuple[Part, float]:
    """The engine's seconds for the rows still to compute (identical inputs once, where the run collapses
    them on this engine), and their tokens."""
    points = rate_points(spec, engine, parts or {}, trials, gate_rate)
    out_per_row = (output_tokens_per_row(spec, [t for _, t in trials if t.engine == engine])
                   if spec.mode == "generate" else 0.0)
    collapsed = sample.distinct < 1.0 and bypass_reason(spec, engine) is None
    lengths = sample.computed_lengths(collapsed) or [1]
    row_share = sample.rows_to_compute(collapsed) / len(lengths)
    tokens = row_share * sum(n + out_per_row for n in lengths)
    repeats = f"; {sample.distinct_source}" if collapsed else ""
    if sample.gate_kept:
        repeats += (f"; the gate's {sample.gate_kept:,} sample rows (the corpus's own) computed in the gate and "
                    "kept in the row cache")
    if sample.probe_kept:
        repeats += f"; the answers' probe's {sample.probe_kept:,} rows, generated before this and kept in the row cache"
    # parts None: the trials' rates alone, as auto weighs the engines (predicted_engine)
    by_calls = calls_part(spec, engine, sample, trials, collapsed, tokens, repeats) if parts is not None else None
    if by_calls is not None:
        return by_calls, tokens
    answered = (f"; {out_per_row:,.0f} output tokens a row ({job_answers(spec, trials)[2]})"
                if spec.mode == "generate" else "")
    if not points:
        quantization = spec.model.quantization
        rate = default_rate_here(engine, spec.mode, quantization)
        return Part(name="engine", seconds=tokens / rate, source=f"default: {engine} never measured here for "
                    f"this job, {rate:,.0f} tokens/s ({default_rate(engine, spec.mode, quantization):,.0f}"
                    f"{f' ({quantization})' if quantization else ''}{compute_speed(spec.mode, quantization)[1]})"
                    f"{answered}{repeats}"), tokens
    curve = [(mean + out_per_row, rate) for mean, rate, _ in points]
    seconds = row_share * sum((n + out_per_row) / rate_at(curve, n + out_per_row) for n in lengths)
    measured_at = ", ".join(f"{m:,.0f} ({where})" for m, _, where in points)
    source = (f"{tokens / seconds if seconds else 0:,.0f} tokens/s over the sample's lengths, from {engine} "
              f"measured here at {measured_at} tokens a row{flat_beyond(curve, lengths, out_per_row)}{answered}"
              f"{repeats}")
    return Part(name="engine", seconds=seconds, source=source), tokens


# A rate read at a length more than this factor beyond every length measured here is read flat from the nearest
# (rate_at), an assumption the prediction states: on a 2-core Zen 5 EPYC (bench/PREDICTION.md run 57) transformers
# ran MiniLM's ~255-token rows 16% slower a token than its ~20-token rows, where a Zen 3 EPYC ran them within 5%;
# the long corpus's first run, its engine judged from the short corpus's trial, was put 17% under.
FLAT_BEYOND = 2.0


def flat_beyond(curve: list[tuple[float, float]], lengths: list[int], out_per_row: float) -> str:
    """Nothing where most of the job's tokens are in rows within FLAT_BEYOND of the lengths measured (the curve's
    means, output tokens included); else the share of its tokens in rows longer (or shorter) than those, read at
    the nearest length's rate, and those rows' input length (token-weighted median), said."""
    low, high = min(m for m, _ in curve) / FLAT_BEYOND, max(m for m, _ in curve) * FLAT_BEYOND
    total = sum(n + out_per_row for n in lengths)
    for side, beyond in (("longer", [n for n in lengths if n + out_per_row > high]),
                         ("shorter", [n for n in lengths if n + out_per_row < low])):
        tokens = sum(n + out_per_row for n in beyond)
        if total and tokens >= 0.5 * total:
            weighted, half = 0.0, tokens / 2
            for n in sorted(beyond):
                weighted += n + out_per_row
                if weighted >= half:
                    break
            return (f"; {tokens / total:.0%} of its tokens in rows of ~{n:,} input tokens, {side} than any "
                    "measured here: read at the nearest measured length's rate (a stated assumption: a rate "
                    "changes with length)")
    return ""


def call_fit(spec: JobSpec, engine: str, trials) -> tuple[list[float] | None, str]:
    """The fit of a generation call's seconds (call_costs.fit_stalled) to the calls measured here for this
    family on this engine: its trials', its runs' and the answers' probe's; and what it was fit to."""
    measured = ([c for _, t in trials if t.engine == engine for c in t.calls]
                + call_costs.read_calls(cache_dir(), rates_key(spec, engine)))
    coefficients, stalled = call_costs.fit_stalled(measured)
    return coefficients, f"fit to {len(measured) - stalled} calls measured here" + (
        f", {stalled} left out: {'it' if stalled == 1 else 'they'} ran over {call_costs.STALLED}x the others' fit, "
        f"stalled" if stalled else "")


def trial_calls(spec: JobSpec, engine: str, lengths: list[int], trials) -> tuple[float, str] | None:
    """Generate: the seconds of an engine's trial after its start, as its calls' (trial_call_plan), at the call
    costs measured here for this family on this engine (calls_part's fit: on a first run, the answers' probe's
    calls), the answers at the trial's cap. The trial's tokens over a rate put SmolLM2's on transformers at
    9.4 s where it took 13.0-15.7 (its calls are few rows each). None where the calls measured are too few."""
    if spec.mode != "generate" or spec.generation.n > 1 or not lengths:
        return None
    coefficients, fitted_to = call_fit(spec, engine, trials)
    if coefficients is None:
        return None
    cap = min(spec.generation.max_tokens, TRIAL_MAX_TOKENS)
    answers, prompts, _ = job_answers(spec, trials)
    calls, prefill = trial_call_plan(spec, engine, lengths)
    concurrency, pads = spec.batching.max_batch_size, engine_pads(engine)
    seconds, _ = call_costs.calls_seconds(coefficients, calls, pads,
                                          call_costs.AnswerDraws([min(a, cap) for a in answers], prompts), concurrency)
    if prefill:
        seconds += sum(k * f for k, f in zip(coefficients, call_costs.call_shape(
            pads, prefill, 1, len(prefill), concurrency).features()))
    fitted = call_costs.describe_fit(coefficients)
    return seconds, (f"{seconds:.1f} s for {len(calls) + bool(prefill)} calls at {fitted} "
                     f"({fitted_to}), answers at the trial's cap of {cap}")


def trial_call_plan(spec: JobSpec, engine: str, lengths: list[int]) -> tuple[list[list[int]], list[int]]:
    """A generation trial's calls as engine_choice.run_trial makes them, each as its prompts' lengths: the
    warm-up call, the timed calls as the runner plans them, the call of another width (_other_width); and
    apart, the prefill call's (one token each; none on an engine that does not pad)."""
    warm, timed = split_warm(lengths)
    planned = plan_feed(list(timed), spec, engine)
    pads = engine_pads(engine)
    calls = [warm] + [[timed[i] for i in call] for call in planned]
    other = [kept for _, kept in other_width_call(list(timed), {len(c) for c in planned}, pads)]
    prefill = sorted(timed)[-prefill_rows(spec):] if pads else []
    return calls + ([other] if other else []), prefill


def job_answers(spec: JobSpec, trials) -> tuple[list[int], list[int], str]:
    """Generate: the answers' lengths a job's rows will have (call_costs.answer_lengths) and their prompts'
    lengths (empty where not kept), from what generated this job's corpus and prompt here
    (engine_choice.corpus_answers: its runs, its probe, its calibration, its trials); else every row's to the
    cap, an upper bound (another corpus's answers say nothing of this one's)."""
    cap = spec.generation.max_tokens
    measured = answers_at_cap(spec, [t for _, t in trials])
    if measured is None:
        return [cap], [], (f"every answer to the cap ({cap} tokens), an upper bound: no run, trial or calibration "
                           "generated this corpus with this prompt here")
    answers, prompts, source = measured
    drawn = ", each row's drawn from those of prompts of its length" if prompts else ""
    return answers, prompts, f"answers of {statistics.fmean(answers):.0f} tokens a row ({source}{drawn})"


def calls_part(spec: JobSpec, engine: str, sample: JobSample, trials, collapsed: bool, tokens: float,
               repeats: str) -> Part | None:
    """Generate: the engine's seconds as the job's calls' seconds (tokenmill.call_costs), fit to the calls
    measured here for this family on this engine: its trials' and its runs'. None where they are too few
    (or n > 1), and the tokens/s curve answers."""
    if spec.mode != "generate" or spec.generation.n > 1:
        return None
    coefficients, fitted_to = call_fit(spec, engine, trials)
    if coefficients is None:
        return None
    answers, prompts, answered = job_answers(spec, trials)
    rows = sample.rows_to_compute(collapsed)
    seconds, calls, steps = call_costs.job_seconds(
        coefficients, lambda lengths: plan_feed(lengths, spec, engine), sample.computed_lengths(collapsed) or [1],
        rows, sample.shards, engine_pads(engine), answers, spec.batching.max_batch_size, prompts)
    return Part(name="engine", seconds=seconds, source=(
        f"{calls:,} calls of {steps:.0f} steps on average, at {call_costs.describe_fit(coefficients)} ({engine}: "
        f"{fitted_to}); {answered}; {tokens / seconds if seconds else 0:,.0f} "
        f"tokens/s{repeats}"))


# ---- the job -----------------------------------------------------------------------------------------

def finished_shards(spec: JobSpec, shards) -> set[str]:
    """Ids of the shards the output's manifest (final or partial) already holds with these fingerprints."""
    try:
        store = OutputStore(spec.output, spec.storage_options)
        manifest = store.read_json(store.path(MANIFEST))
    except Exception:  # noqa: BLE001 - no manifest (or none readable): nothing is finished
        return set()
    if manifest.get("mode") != spec.mode or manifest.get("model") != spec.model_name:
        return set()
    done = {(s["shard_id"], s["fingerprint"]) for s in manifest.get("shards", [])}
    return {s.shard_id for s in shards if (s.shard_id, s.fingerprint) in done}


def job_sample(spec: JobSpec) -> JobSample:
    """The rows still to compute (finished shards and the row cache's share left out) and the token
    lengths of the job's sample: the one its engine trial takes."""
    shards = discover_shards_for(spec)
    done = finished_shards(spec, shards)
    rows = rows_per_shard(spec, shards)
    todo = [(s, n) for s, n in zip(shards, rows) if s.shard_id not in done]
    model_path = resolve_model(spec.model_name)
    timeline.mark("sample_read_start")  # the first wins: a run's is its prediction's, on its main thread
    trial_rows, sampled = sampled_inputs(spec, model_path, [TRIAL_ROWS[spec.mode], LENGTH_SAMPLE_ROWS[spec.mode]])
    timeline.mark("sample_read_done")
    trial = [len(r) for r, _ in trial_rows]
    read_tokens = sum(trial) + sum(len(r) for r, _ in sampled)
    read_chars = sum(text_chars(source) for _, source in trial_rows) + sum(text_chars(source) for _, source in sampled)
    chars_per_row = statistics.fmean(text_chars(source) for _, source in sampled) if sampled else 0.0
    lengths = [len(r) for r, _ in sampled]
    share = 0.0
    if todo and spec.cache.enabled and _row_cache_exists(spec):
        share, _ = row_cache_share(spec, [s for s, _ in todo], [n for _, n in todo], len(trial))
    rows_read = sum(n for _, n in todo)
    distinct, counted, counts = distinct_share(spec, [s for s, _ in todo])
    distinct_lengths = distinct_sample(spec, sampled, counts)
    return JobSample(rows=round(rows_read * (1.0 - share)), shards=len(todo), lengths=lengths,
                     distinct_lengths=distinct_lengths, trial_lengths=trial,
                     row_cache_share=share, finished_shards=len(done), distinct=distinct,
                     distinct_source=counted, rows_read=rows_read, read_tokens=read_tokens,
                     read_chars=read_chars, chars_per_row=chars_per_row)


def text_chars(source: Any) -> int:
    """The characters a row was encoded from (sampling.prompt_inputs: its text, or a mapping of a prompt's
    fields): what reading and tokenizing it cost grows with, whatever of it truncation keeps."""
    if isinstance(source, str):
        return len(source)
    if isinstance(source, dict):
        return sum(len(str(value)) for value in source.values())
    return len(str(source))


def distinct_share(spec: JobSpec, shards) -> tuple[float, str, Counter | None]:
    """The share of these shards' rows the engine computes once identical inputs are computed once
    (tokenmill.row_cache: collapsed within a shard; with the row cache on, a later shard also finds an
    earlier one's rows in it), counted over the inputs as read: the columns the prompt is made from; and,
    collapsed across shards, how many rows read each input had (distinct_sample). (1.0, "", None) when the
    run collapses nothing or the inputs cannot be read here."""
    if not shards or not (spec.cache.enabled or spec.cache.collapse_duplicates) or any(
            s.format == "openai-batch" for s in shards):
        return 1.0, "", None
    columns = [c for c in (text_column_used(spec), *prompt_columns(spec),
                           spec.generation.messages_column if spec.mode == "generate" else None) if c]
    seen: Counter = Counter()
    read = distinct = 0
    try:
        for shard in shards:
            table, _ = read_shard(shard, columns, spec.storage_options)
            values = [table.column(c).to_pylist() for c in columns if c in table.column_names]
            keys = [_input_key(v) for v in zip(*values)]
            if not spec.cache.enabled:  # collapse alone: within each shard
                seen = Counter()
            before = len(seen)
            seen.update(keys)
            read, distinct = read + len(keys), distinct + len(seen) - before
            if read >= DISTINCT_ROWS_READ:
                break
    except Exception:  # noqa: BLE001 - an input this sample cannot read: the run meets and reports it
        return 1.0, "", None
    if not read or distinct == read:
        return 1.0, "", None
    scope = "across shards" if spec.cache.enabled else "within each shard"
    counted = "all" if shard is shards[-1] else f"the first {read:,}"
    return distinct / read, (f"identical inputs computed once: {distinct:,} distinct of {read:,} rows "
                             f"({scope}), counted over {counted} rows"), seen if spec.cache.enabled else None


def distinct_sample(spec: JobSpec, sampled: list[tuple[list[int], Any]], counts: Counter | None) -> list[int]:
    """The lengths of the distinct inputs a run that collapses identical ones computes, from the corpus's sample
    (rows, each with what it was encoded from): each row counted as one over the rows its input has in the
    corpus (distinct_share's counts), so that an input weighs as much as any other whatever its copies; kept
    as lengths by a running sum of those shares, one row each time it passes a whole, over the rows in the order
    of their inputs' digests (an input's copies together). The sample's distinct rows alone had the inputs
    repeated across the corpus (the demo's short rows) in it as often as the rest: `make run`'s 16,950 distinct
    rows were put at 84.8 tokens a row against the 90.3 its engine computed (this: 90.6). Without counts
    (collapsed within shards, or inputs this cannot key: a messages column's), the sample's distinct rows."""
    keys = [_sample_key(spec, value) for _, value in sampled] if counts else []
    if not keys or any(k is None or k not in counts for k in keys):
        return [len(r) for r in dict.fromkeys(tuple(r) for r, _ in sampled)]
    order = sorted(range(len(sampled)), key=lambda i: stable_digest(str(keys[i]), 16))
    kept, share = [], 0.0
    for i in order:
        before, share = share, share + 1.0 / counts[keys[i]]
        if math.floor(share + 1e-9) > math.floor(before + 1e-9):
            kept.append(len(sampled[i][0]))
    return kept or [len(sampled[order[0]][0])]


def _sample_key(spec: JobSpec, value: Any) -> Any:
    """distinct_share's key of a sampled row's input (sampling.prompt_inputs': a text, or a mapping of the text
    and the prompt's other columns); None for a messages column's, which is keyed as read, not as a chat."""
    if isinstance(value, str):
        return _input_key((value,))
    if isinstance(value, dict) and TEXT in value and "messages" not in value:
        return _input_key((value[TEXT], *(value.get(c) for c in prompt_columns(spec))))
    return None


def _input_key(values: tuple) -> Any:
    return values if all(isinstance(v, (str, type(None))) for v in values) else json.dumps(values, default=str)


def _row_cache_exists(spec: JobSpec) -> bool:
    try:
        store = OutputStore(cache_uri(spec), spec.storage_options)
        return store.fs.exists(store.root)
    except Exception:  # noqa: BLE001 - unreadable: read as empty
        return False


def predicted_engine(spec: JobSpec, sample: JobSample, trials) -> tuple[str, str]:
    """The engine the job will run on, and why: as written, the one this run's trials chose before its prediction
    (trials_ahead), or auto's choice by the trials' curve (before any trial: as auto will weigh them, at the
    defaults, the trial's last engine kept open). Not a choice a plan or a calibration made in its own process:
    they choose with the trials' last engine open, or by throughput alone; a run weighs every start."""
    if spec.model.engine != "auto":
        return spec.model.engine, "as written"
    chosen = chosen_engine(spec)
    if chosen is not None and trials_ahead(spec) is not None:  # this run's trials, before its prediction, chose
        return chosen.engine, "auto, chosen by this run's trials: " + chosen.reason
    able, _ = runnable_engines(spec)
    if len(able) == 1:
        return able[0], "the only engine that can run it here"
    measured = {t.engine for _, t in trials} & set(able)
    if measured != set(able):
        tokens = engine_part(spec, able[0], sample, [])[1]
        seconds = {e: weighed_start(e, default_start(e, spec.mode), {trial_order(able)[-1]}, True)
                   + tokens / default_rate(e, spec.mode) for e in able}
        return (min(seconds, key=seconds.get),
                f"default: auto's choice at the default starts and rates (the trial's last engine kept open, "
                "the others started again), before any trial")
    # as auto weighs them (engine_choice.choose_engine): the trial's start, but none for an engine open (the
    # trials' last, where this run's trials run: a new length), then the job at the trial's rate. Weighed with
    # every start, a long corpus's first run was put on transformers where each run here chose vLLM, open
    # from its trial (bench/PREDICTION.md runs 23a-24b: +1.7% to +7.8%, its close and transformers' start)
    kept = trial_order(able)[-1] if trials_run(spec, sample, able) else None
    seconds = {e: weighed_start(e, trial_start(spec, e, sample, trials), {kept} if kept else set(), bool(kept))
               + engine_part(spec, e, sample, trials)[0].seconds for e in able}  # the trials' figures alone
    return min(seconds, key=seconds.get), ("auto, by the trials' starts and rates" + (
        f", {kept} open from its trial" if kept else ""))


def trials_ahead(spec: JobSpec) -> float | None:
    """The seconds of the engine trials auto ran in this process before its prediction (`tokenmill run` of an
    embedding job with no trials here at its length: tasks/warm.py's choose_engine_first, before the API's
    start, as the gate's judge_first), else None. Predicted from the defaults, a first run's trials were the
    miss of the first runs (bench/PREDICTION.md: vLLM's compiling start read 98 s by the default at the
    probe's speed, ~69 s measured): measured first, the prediction holds them as measured, and which
    engine they chose."""
    choice = chosen_engine(spec)
    if choice is None or choice.cached or not choice.trials or not timeline.measures_process():
        return None
    marks = timeline.marks()
    if not marks.get("cli_ready", math.inf) <= marks.get("engine_choice_start", -math.inf) \
            < marks.get("engine_choice_done", -math.inf):
        return None
    return _span(marks, "engine_choice_start", "engine_choice_done")


def parts_after_trials(spec: JobSpec, sample: JobSample, parts: dict[str, Any], fixed: str, seconds: float,
                       able: list[str]) -> list[Part]:
    """A run whose auto trials ran before its prediction (trials_ahead): its imports, its start to the trials
    (the model probe, the sample corpus, the flow's imports, the API's start waited out) and the trials, measured;
    then the main thread's work after them, one step after another (the API answered already, no engine start
    beside it): reading the job's sample, MLflow's store, the rest of the main thread, and the flow's start."""
    marks = {"process": timeline.process_started(), **timeline.marks()}
    before = _span(marks, "cli_ready", "engine_choice_start")
    read, read_source = reading_part(parts, spec.mode, sample.read_tokens, sample.read_chars)
    _, tracking, tracking_source = tracking_part(spec, parts)
    main, flow = (_seconds(parts, fixed, name) for name in (MAIN, "flow start"))
    after = read + tracking + main["seconds"] + flow["seconds"]
    return [Part(name="python imports", seconds=_span(marks, "process", "cli_ready"), source="this process, measured"),
            Part(name="orchestration start", seconds=before + after, source=(
                f"{before:.1f} s to the trials, the API's start waited out, measured; then {READING} {read:.1f} s "
                f"({read_source}), MLflow's store {tracking:.1f} s ({tracking_source}), main thread "
                f"{main['seconds']:.1f} s ({main['source']}), flow start {flow['seconds']:.1f} s ({flow['source']})")),
            Part(name="engine trials", seconds=seconds, source=(
                f"{seconds:.1f} s before this prediction, no trials here at this job's length yet: "
                f"{', '.join(trial_order(able))} measured on its sample (tasks/warm.py: choose_engine_first), measured"))]


def trials_run(spec: JobSpec, sample: JobSample, able: list[str]) -> bool:
    """Whether this run's auto runs engine trials (none kept here for this job's length)."""
    return spec.model.engine == "auto" and len(able) > 1 and not trials_cached(
        spec, statistics.fmean(sample.trial_lengths) if sample.trial_lengths else None)


def default_start(engine: str, mode: str) -> float:
    return DEFAULT_ENGINE_START.get((engine, mode), 4.0 if engine != "vllm" else 35.0)


def trial_start(spec: JobSpec, engine: str, sample: JobSample, trials) -> float:
    """The engine's start seconds in its trial nearest the sample's mean length (0 when it has none)."""
    mine = [(mean, t) for mean, t in trials if t.engine == engine]
    if not mine:
        return 0.0
    mean = statistics.fmean(sample.lengths or [1])
    return min(mine, key=lambda m: abs(math.log(m[0]) - math.log(max(mean, 1.0))))[1].start_seconds


def overhead_part(parts: dict[str, Any], key: str, length: int, rows: int, chars: float = 0.0) -> Part:
    """Reading, tokenizing and writing the rows outside the engine, per 1,000 rows at this length class as
    measured here; else scaled from the nearest length class measured here, at most MAX_LENGTH_CLASSES_SCALED
    away; else the default at this machine's speed. Scaled by the text each row is read from: `chars`, the job's
    sample's characters a row, against those of the runs that measured it (OVERHEAD_CHARS; the default's:
    OVERHEAD_DEFAULT_CHARS), where both are known; else by the rows' length class (a class is twice the tokens
    a row of the one below: the runs here took 0.0-0.1 s per 1,000 rows of ~19 tokens, 0.2 of ~57, 1.1-1.3 of
    ~255). Of several runs' figures, their lower quartile (the lowest of 2-4): what a run spends here outside the
    engine is its rows' work plus stalls of the host's that do not grow with the rows, and a figure per 1,000
    rows carries a small job's stall to a large one multiplied (run 53: 0.2 and 0.5 s per 1,000 rows from two
    1,000-row jobs, where runs 51-52 read 0.1 from each; their median put the 8,000-row job's overhead at 2.9 s
    against the 0.8 it took, +17.6% on its wall)."""
    def by_text(seconds: float, at: int | None) -> tuple[float, str] | None:
        measured = OVERHEAD_DEFAULT_CHARS if at is None else stored(parts, key, f"{OVERHEAD_CHARS}@{at}", None)[0]
        if not chars or not measured:
            return None
        return seconds * chars / measured, f"x {chars:,.0f} characters a row against {measured:,.0f}"

    seconds, source = stored(parts, key, f"{OVERHEAD}@{length}", None, low=True)
    if seconds is not None:
        source += " at this length"
        scaled = by_text(seconds, length)
        if scaled is not None:
            seconds, source = scaled[0], f"{source}, {scaled[1]}"
    else:
        classes = [int(at) for name, values in parts.get(key, {}).items() if values
                   for base, _, at in [name.partition("@")] if base == OVERHEAD and at.isdigit()]
        if not classes:  # measured on another engine of this device and mode only (stored's fallback)
            classes = [at for at in range(length - MAX_LENGTH_CLASSES_SCALED, length + MAX_LENGTH_CLASSES_SCALED + 1)
                       if stored(parts, key, f"{OVERHEAD}@{at}", None)[0] is not None]
        measured = sorted((abs(at - length), at) for at in classes)
        if measured and measured[0][0] <= MAX_LENGTH_CLASSES_SCALED:
            nearest = [at for gap, at in measured if gap == measured[0][0]]
            each = [stored(parts, key, f"{OVERHEAD}@{at}", None, low=True)[0] for at in nearest]
            texts = [by_text(value, at) for value, at in zip(each, nearest)]
            if all(texts):
                seconds, how = statistics.fmean(t[0] for t in texts), "; ".join(t[1] for t in texts)
            else:
                seconds = statistics.fmean(value * 2.0 ** (length - at) for value, at in zip(each, nearest))
                how = f"x the rows' length (~{2 ** length} tokens)"
            runs = len(parts.get(key, {}).get(f"{OVERHEAD}@{nearest[0]}") or [None])
            source = (f"measured here at {' and '.join(f'~{2 ** at} tokens a row' for at in nearest)} "
                      f"({of_runs(runs, low=True)}), {how}")
        else:  # the default is at OVERHEAD_DEFAULT_LENGTH (OVERHEAD_DEFAULT_CHARS), in proportion to the rows' text
            factor, why = machine_speed()
            seconds, source = DEFAULT_SECONDS[OVERHEAD] * factor, f"default: never measured here, {DEFAULT_SECONDS[OVERHEAD]:g} s{why}"
            scaled = by_text(seconds, None)
            if scaled is not None:
                seconds, source = scaled[0], f"{source} at ~{OVERHEAD_DEFAULT_CHARS:,} characters a row, {scaled[1]}"
            else:
                scale = 2.0 ** (length - OVERHEAD_DEFAULT_LENGTH)
                seconds *= scale
                source += (f" ({DEFAULT_SECONDS[OVERHEAD]:g} s at ~{2 ** OVERHEAD_DEFAULT_LENGTH} tokens a row, "
                           f"x{scale:g} for the rows' length, ~{2 ** length} tokens)")
            if measured:
                source += (f"; measured here only at ~{2 ** measured[0][1]} tokens a row, more than "
                           f"{MAX_LENGTH_CLASSES_SCALED} length classes away")
    return Part(name="shard overhead", seconds=seconds * rows / 1000, source=f"{seconds:.2f} s per 1,000 rows, {source}")


def predict(spec: JobSpec, sample: JobSample, parts: dict[str, Any], trials, early_start: bool = True,
            gate_rate: tuple[float, float, str] | None = None, gate_makes: bool = False) -> Prediction:
    """The whole process's seconds in parts (see the module's docstring); reads nothing but this job's
    sample, this job's trials (`trials`) and the parts measured here for its engine (`parts`).
    early_start: the engine starts beside the API's start (tasks/warm.py), not after it (a gated job's);
    gate_rate: the model's rate on a gate's sample here, (mean tokens a row, tokens/s, where), where one was kept;
    gate_makes: a gate before the corpus makes the models its engine runs (engine_start_part)."""
    engine, why = predicted_engine(spec, sample, trials)
    if sample.probe_engine not in ("", engine):  # the probe's rows are kept under another engine (auto's trials)
        sample = sample.model_copy(update={"probe_kept": 0})
    fixed = fixed_key(spec, engine)
    able = runnable_engines(spec)[0]
    ahead = trials_ahead(spec)  # ran before this prediction (tasks/warm.py: choose_engine_first): measured
    trial_runs = ahead is None and trials_run(spec, sample, able)
    idle = sample.shards == 0 and not trial_runs  # every shard finished: no engine starts (tasks/warm.py)
    alone = idle or not trial_runs and not early_start  # no engine starts before the flow (MAIN_ALONE)
    trialed = trial_runs or ahead is not None  # the trials' last engine open, the others closed after theirs
    if trialed and engine == trial_order(able)[-1]:
        start = Part(name="engine start", seconds=0.0, source=f"{engine}: kept open from its trial")
    elif trialed:
        start = restart_part(spec, engine)
    elif idle:
        start = Part(name="engine start", seconds=0.0, source=f"{engine}: every shard finished, none starts")
    else:
        start = engine_start_part(spec, engine, sample, parts, trials, gate_makes)
    if ahead is not None:  # the process up to the trials' end is measured; the API answered before them
        out = parts_after_trials(spec, sample, parts, fixed, ahead, able)
    else:
        out = [Part(name="python imports", **_seconds(parts, fixed, "python imports")),
               orchestration_part(parts, fixed, 0.0 if trial_runs or not early_start else start.seconds,
                                  main_thread_parts(spec, sample, parts, alone), alone=alone,
                                  api_created=timeline.measures_process() and "api_store_created" in timeline.marks())]
    if trial_runs:
        out.append(trials_part(spec, sample, parts, able, trials, kept=engine == trial_order(able)[-1]))
    engine_seconds, tokens = engine_part(spec, engine, sample, trials, parts, gate_rate)
    out += [start, engine_seconds]
    factor, why = machine_speed()
    out.append(Part(name="shard tasks", seconds=PER_SHARD_SECONDS * factor * sample.shards, source=(
        f"default: {PER_SHARD_SECONDS:g} s a shard{why}, never measured apart (a Prefect task's "
        f"run, state and result), x {sample.shards}")))
    if sample.finished_shards:
        seconds, source = stored(parts, machine_key(), FINISHED_SHARD, DEFAULT_FINISHED_SHARD)
        out.append(Part(name="finished shards", seconds=seconds * sample.finished_shards,
                        source=f"{seconds:.2f} s a shard, its task reading the result kept ({source}), "
                               f"x {sample.finished_shards}"))
    out.append(overhead_part(parts, fixed, length_class(statistics.fmean(sample.lengths or [1])),
                             sample.rows_read or sample.rows, sample.chars_per_row))
    if spec.index is not None and spec.mode == "embed":
        seconds, source = stored(parts, fixed, "index build per 1,000 rows", DEFAULT_SECONDS["index build per 1,000 rows"])
        out.append(Part(name="index build", seconds=seconds * sample.rows / 1000,
                        source=f"{seconds:.2f} s per 1,000 rows, {source}"))
    out.append(Part(name="finish", **_seconds(parts, fixed, "finish")))
    out.append(exit_part(parts, fixed, engine, gate_makes=gate_makes, idle=idle))
    if why.startswith("default"):
        out[0].source += f"; engine {engine}: {why}"
    rows = sample.rows_to_compute(collapses(spec, engine, sample))
    return Prediction(engine=engine, rows=rows, tokens=tokens, parts=out, read_tokens=sample.read_tokens,
                      read_chars=sample.read_chars, chars_per_row=sample.chars_per_row)


def exit_part(parts: dict[str, Any], fixed: str, engine: str, gate_makes: bool, idle: bool) -> Part:
    """The process's exit: with the gate's models where the gate measures, with no engine where none opens,
    else with the engine's. An engine's exit never measured alone here but measured after a measuring gate
    (the gate's run before this one: the same engine's close and the gate's models' beside it) is read from
    that, not from the default (see DEFAULT_ENGINE_EXIT)."""
    if gate_makes:  # before idle: a gate that measures opens its models whether or not a shard is left
        seconds, source = stored(parts, fixed, GATE_EXIT, DEFAULT_GATE_EXIT)
        return Part(name="exit", seconds=seconds, source=f"{engine} and the gate's models: {source}")
    if idle:
        seconds, source = stored(parts, fixed, IDLE_EXIT, DEFAULT_IDLE_EXIT.get(engine, 2.2))
        return Part(name="exit", seconds=seconds, source=f"no engine to close ({engine}): {source}")
    measured = parts.get(fixed, {})
    if measured.get("exit") or not measured.get(GATE_EXIT):
        seconds, source = stored(parts, fixed, "exit", default_exit(engine))
    else:
        seconds, source = stored(parts, fixed, GATE_EXIT, None)
        source = f"never measured here alone, read from its exit after a measuring gate ({source})"
    return Part(name="exit", seconds=seconds, source=f"{engine}: {source}")


def _seconds(parts: dict[str, Any], key: str, name: str) -> dict[str, Any]:
    seconds, source = stored(parts, key, name, DEFAULT_SECONDS[name])
    return {"seconds": seconds, "source": source}


def collapses(spec: JobSpec, engine: str, sample: JobSample) -> bool:
    """Whether the run computes identical inputs once on this engine (deterministic requests only)."""
    return sample.distinct < 1.0 and bypass_reason(spec, engine) is None


def orchestration_part(parts: dict[str, Any], key: str, engine_start: float,
                       apart: list[tuple[str, float, str]] = (), alone: bool = False,
                       api_created: bool = False) -> Part:
    """Prefect's API starts in its own process beside the main thread's work (the flow's imports, this
    prediction, and the parts of it measured apart, `apart`: (name, seconds, source) each, see
    main_thread_parts; but for BEFORE_API's, a first `tokenmill run`'s probe and a gated run's sample corpus, whose
    seconds come before the API starts) and the engine's start (`engine_start`: the start it overlaps; 0 when a trial runs
    first, which waits for the API), then the flow starts: what of it the engine's start does not hide.
    alone: no engine starts beside the API (MAIN_ALONE); api_created: the API creates its database first
    (API_CREATED)."""
    api, main, flow = (_seconds(parts, key, name) for name in ("orchestrator API", MAIN, "flow start"))
    created, created_source = stored(parts, machine_key(), API_CREATED, DEFAULT_API_CREATED)
    if api_created:
        api = {"seconds": created, "source": f"{created_source}, creating its database: the first here"}
    elif api["source"].startswith("default") and not created_source.startswith("default"):
        api = later_api_start(parts, created, created_source, api)
    if main["source"].startswith("default"):
        beside, source = stored(parts, key, MAIN_BESIDE_TRIAL, None)
        if beside is not None:
            main = {"seconds": beside * MAIN_FROM_TRIAL,
                    "source": f"{source}, in runs with trials: {beside:.1f} s x {MAIN_FROM_TRIAL:g}, a warm run's share"}
    if alone:
        own, source = stored(parts, key, MAIN_ALONE, None)
        first_run, first_source = stored(parts, key, MAIN_FIRST_ALONE, None)
        if own is None and first_run is not None:
            own, source = first_run * MAIN_FROM_TRIAL, (f"{first_source}, in the machine's first run: {first_run:.1f} s "
                                                         f"x {MAIN_FROM_TRIAL:g}, a later run's share")
        factor, speed = machine_speed()
        main = {"seconds": own, "source": f"{source}, no engine starting beside it"} if own is not None else {
            "seconds": main["seconds"] + DEFAULT_ALONE_EXTRA * factor, "source": (
                f"{main['source']}, + {DEFAULT_ALONE_EXTRA:g} s{speed} (default: never measured here with no engine "
                "starting beside it)")}
    first = [(name, sec, why) for name, sec, why in apart if name in BEFORE_API]
    beside = [(name, sec, why) for name, sec, why in apart if name not in BEFORE_API]
    thread = main["seconds"] + sum(seconds for _, seconds, _ in beside)
    before = sum(seconds for _, seconds, _ in first)
    seconds = before + max(api["seconds"], thread + engine_start) - engine_start + flow["seconds"]
    return Part(name="orchestration start", seconds=seconds, source=(
        "".join(f"{name} {sec:.1f} s, {why}; then " for name, sec, why in first)
        + f"API {api['seconds']:.1f} s ({api['source']}) beside main thread {thread:.1f} s ({main['seconds']:.1f} s "
        f"{main['source']}" + "".join(f"; {name} {sec:.1f} s, {why}" for name, sec, why in beside)
        + f") + engine start {engine_start:.1f} s; flow start {flow['seconds']:.1f} s ({flow['source']})"))


def main_thread_parts(spec: JobSpec, sample: JobSample, parts: dict[str, Any],
                      alone: bool = False) -> list[tuple[str, float, str]]:
    """The main thread's work measured apart from the rest of it, (name, seconds, source) each: reading the
    job's sample; opening MLflow's store (`alone`: with no engine started before it, TRACKING_ALONE), or
    creating it where it is not there yet (a first run's); and
    writing the demo's sample corpus, where this process did before it predicted (a first `tokenmill run`
    of the demo: measured, since it is done); the machine's model probe, where this process ran it (a first
    command here: probe_speed); generating the answers' probe, where this process did
    (tokenmill.answer_probe: measured too; with the start of its engine where that is auto's trials' first,
    not the job's)."""
    read, read_source = reading_part(parts, spec.mode, sample.read_tokens, sample.read_chars)
    out = [(READING, read, read_source), tracking_part(spec, parts, alone)]
    marks = timeline.marks()
    written = _span(marks, "sample_corpus_start", "sample_corpus_written")
    if written and timeline.measures_process():
        first = marks["sample_corpus_written"] <= marks.get("api_start", math.inf)  # for the gate that reads it first
        out.append((SAMPLE_WRITTEN_BEFORE_API if first else "writing the sample corpus", written,
                    f"this process wrote it before it predicted{', before the API started' if first else ''}, measured"))
    modelled = _span(marks, "model_probe_start", "model_probe_done")
    if modelled and timeline.measures_process() and marks.get("cli_ready", math.inf) <= marks["model_probe_start"]:
        # a run's (tokenmill.cli marks cli_ready in `run` only): a plan or a calibration that probed predicts a run
        # that will not. `tokenmill run` probes before the API starts (probe_machine): its seconds come first
        first = marks["model_probe_done"] <= marks.get("api_start", math.inf)
        out.append((MODEL_PROBE_BEFORE_API if first else MODEL_PROBE_PART, modelled,
                    "the first command here probed its compute before it predicted "
                    f"(tokenmill.device.model_tokens_per_s){', before the API started' if first else ''}, measured"))
    probed = _span(marks, "answer_probe_start", "answer_probe_done")
    if probed and timeline.measures_process():
        started = "" if "early_engine_start" in marks else f", {sample.probe_engine}'s start within it"
        out.append((ANSWER_PROBE, probed, "this process generated the corpus's sample at the job's cap before "
                    f"it predicted (tokenmill.answer_probe){started}, measured"))
    return out


def tracking_part(spec: JobSpec, parts: dict[str, Any], alone: bool = False) -> tuple[str, float, str]:
    """Opening the job's MLflow store, as this mode's runs here opened it (else other modes', else its creation
    here less what creating adds), or creating it (TRACKING_CREATED) where it is a local file not there yet.
    alone: no engine starts before it in the process (TRACKING_ALONE): as this mode's runs opened it so, else
    as they opened it after an engine's start, + DEFAULT_TRACKING_ALONE_EXTRA at this machine's speed."""
    store = local_tracking_store(spec)
    if store is not None and not store.exists():
        return (TRACKING_CREATED, *stored(parts, machine_key(), TRACKING_CREATED, DEFAULT_TRACKING[TRACKING_CREATED]))
    if alone:
        seconds, source = stored(parts, machine_key(), f"{TRACKING_ALONE}@{spec.mode}", None)
        if seconds is not None:
            return TRACKING_ALONE, seconds, source
        _, seconds, source = tracking_part(spec, parts)
        factor, speed = machine_speed()
        return TRACKING_ALONE, seconds + DEFAULT_TRACKING_ALONE_EXTRA * factor, (
            f"{source}, + {DEFAULT_TRACKING_ALONE_EXTRA:g} s{speed} (default: never opened here with no engine "
            "started before it)")
    machine = parts.get(machine_key(), {})
    seconds, source = stored(parts, machine_key(), f"{TRACKING_OPENED}@{spec.mode}", None)
    if seconds is not None:
        return TRACKING_OPENED, seconds, source
    # never opened in this mode's runs here: the other modes' (or those stored before it was stored by mode)
    other = [v for name, values in sorted(machine.items()) if name.split("@")[0] == TRACKING_OPENED for v in values]
    if other:
        return TRACKING_OPENED, statistics.median(other), (
            f"measured here in other modes' runs, never in {spec.mode}'s, median of {len(other)}")
    seconds, source = stored(parts, machine_key(), TRACKING_OPENED, DEFAULT_TRACKING[TRACKING_OPENED])
    created, created_source = stored(parts, machine_key(), TRACKING_CREATED, DEFAULT_TRACKING[TRACKING_CREATED])
    if source.startswith("default") and not created_source.startswith("default"):
        # never opened here, but created (a first run's): its creation less what creating adds at the defaults,
        # as the API's first start stands for its later ones (orchestration_part): a 2-core Xeon created it in
        # 2.2 s and opened it in 1.0-1.5 (median 1.2), where the default put an opening at 1.5
        return TRACKING_OPENED, *less_creation("its creation here", created, created_source,
                                               DEFAULT_TRACKING[TRACKING_CREATED] - DEFAULT_TRACKING[TRACKING_OPENED],
                                               (seconds, source))
    return TRACKING_OPENED, seconds, source


def later_api_start(parts: dict[str, Any], created: float, created_source: str,
                    default: dict[str, Any]) -> dict[str, Any]:
    """The API's start in a run of a kind never measured here, from the machine's first start (`created` s: it
    created the database): that start but its startup as the server's process measured it (API_FIRST_REST), +
    a later startup (API_STARTUP, the database there); where no first start's startup was measured apart,
    less_creation (`default`: the API's default start here)."""
    rest, rest_source = stored(parts, machine_key(), API_FIRST_REST, None)
    if rest is None:
        seconds, source = less_creation("its first start here, which created its database", created, created_source,
                                        DEFAULT_API_CREATED - DEFAULT_SECONDS["orchestrator API"],
                                        (default["seconds"], default["source"]))
        return {"seconds": seconds, "source": source}
    startup, startup_source = stored(parts, machine_key(), API_STARTUP, DEFAULT_API_STARTUP)
    return {"seconds": rest + startup, "source": (
        f"its first start here but its startup, where it created its database, {rest:.1f} s ({rest_source}), "
        f"+ a later startup, {startup:.2f} s ({startup_source})")}


def less_creation(what: str, created: float, created_source: str, default_extra: float,
                  default: tuple[float, str]) -> tuple[float, str]:
    """A later opening never measured here, from a first one that created its store here (`created` seconds):
    that, less what creating adds at the defaults (`default_extra` at speed 1) at this machine's speed; at most
    the opening's own default here (`default`: its seconds at this machine's speed and their source). A first run
    creates Prefect's database and MLflow's store beside each other and beside the engine trials' first vLLM
    start, which slows them far more than it slows any later opening: on a 2-core EPYC (bench/PREDICTION.md
    run 36) the API's first start took 12.7 and 21.8 s and MLflow's creation 10.6, where the next runs started the
    API in 4.4-4.6 s and opened the store in 1.4-1.7, and the warm job was put 30.6% and 27.7% over."""
    extra = default_extra * machine_speed()[0]
    seconds = max(created - extra, 0.0)
    why = f"{what}, {created:.1f} s ({created_source}), less that at its default, {extra:.1f} s"
    if seconds <= default[0]:
        return seconds, why
    return default[0], f"{default[1]}, under {why}"


def reading_key(mode: str) -> str:
    return f"{device_label()}|reading|{mode}"


def reading_part(parts: dict[str, Any], mode: str, tokens: int, chars: int = 0) -> tuple[float, str]:
    """The seconds the prediction reads the job's sample in (READING), `chars` characters read (`tokens`
    tokens): by the characters where the sample counted them and runs here stored theirs (READ_CHARS), else by
    the tokens as runs before READ_CHARS stored them. See reading_line."""
    entry = parts.get(reading_key(mode), {})
    seconds, stored_chars = entry.get(READING, []), entry.get(READ_CHARS, [])
    stored_chars = stored_chars[len(stored_chars) - min(len(stored_chars), len(seconds)):]
    if chars and (stored_chars or not seconds):
        # each run stores both: its last readings are those its characters were stored with
        runs = list(zip(stored_chars, seconds[len(seconds) - len(stored_chars):]))
        return reading_line(runs, mode, chars, "characters", DEFAULT_READING_PER_CHAR)
    return reading_line(list(zip(entry.get(READ_TOKENS, []), seconds)), mode, tokens, "tokens",
                        DEFAULT_READING_PER_TOKEN)


def reading_line(runs: list[tuple[float, float]], mode: str, size: int, unit: str, default: float) -> tuple[float, str]:
    """The reading's seconds for `size` `unit` read, from the runs here ((size, seconds) each): on the line through
    them once they read at least twice as much as one another; else the nearest run's seconds, what it did not
    read at the default rate; else the default."""
    factor, speed = machine_speed()
    each, one = default * factor, unit[:-1]
    if not runs:
        return (DEFAULT_READING[mode] * factor + size * each, (
            f"default: never measured here, {DEFAULT_READING[mode]:g} s + {default * 1e6:g} us "
            f"a {one}{speed}, {size:,} {unit}"))
    xs, ys = [float(x) for x, _ in runs], [y for _, y in runs]
    if max(xs) >= 2 * max(min(xs), 1.0):
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        slope = max(sum((x - mean_x) * (y - mean_y) for x, y in runs) / sum((x - mean_x) ** 2 for x in xs), 0.0)
        base = mean_y - slope * mean_x
        if base >= 0:  # else a line no reading is on (a run of another text's cost per unit): the nearest run's
            return base + slope * size, (f"{size:,} {unit} on the line through {len(runs)} runs here ({base:.2f} s "
                                         f"+ {slope * 1e6:.2f} us a {one})")
    near_size, near_seconds = min(runs, key=lambda r: abs(math.log(max(r[0], 1)) - math.log(max(size, 1))))
    return max(near_seconds + (size - near_size) * each, 0.0), (
        f"{size:,} {unit}: a run here read {near_size:,.0f} in {near_seconds:.2f} s, the difference at the "
        f"default {default * 1e6:g} us a {one}{speed}")


def trial_overhead_name(kept: bool) -> str:
    """The trials' cost besides the engines, apart for whether the last engine stays open for the job or
    loses and is closed inside the trials (vLLM's shutdown: seconds)."""
    return "trial overhead" if kept else "trial overhead, the last engine closed"


def trials_part(spec: JobSpec, sample: JobSample, parts: dict[str, Any], able: list[str], trials=(),
                kept: bool = True) -> Part:
    """The engine trials this run will pay for, engine by engine as the trial runs them: each engine's start
    (as measured here for this model and mode: its trials' and runs' starts; none for the one the answers'
    probe opened, which its trial reuses: the probe's seconds hold it), and this sample's trial
    tokens at the engine's rate at the sample's length (the curve its trials and runs measured), plus what
    the trials cost besides (the sample's reading and encoding, closing an engine: measured here, the
    trials' span less each engine's whole trial). An engine never measured here: its stated defaults."""
    mean = statistics.fmean(sample.trial_lengths or sample.lengths or [1])
    each, defaults = [], 0
    for engine in trial_order(able):
        tokens = trial_tokens(spec, sample.trial_lengths or sample.lengths, engine)
        start, start_source = measured_start(spec, engine, parts, trials)
        points = rate_points(spec, engine, parts, trials)
        out_per_row = (output_tokens_per_row(spec, [t for _, t in trials if t.engine == engine])
                       if spec.mode == "generate" else 0.0)
        if engine == sample.probe_engine:  # open: its trial reuses it
            start, start_source = 0.0, "opened by the answers' probe, its start counted there"
        elif start is None:
            start, start_source = default_start_here(engine, spec.mode), "default"
            compiling, why = first_compile(spec, engine, parts, trials)
            if why:
                start, start_source = start + compiling, f"default; {why}"
        if points:
            curve = [(m + min(out_per_row, TRIAL_MAX_TOKENS), r) for m, r, _ in points]
            rate, rate_source = rate_at(curve, mean + min(out_per_row, TRIAL_MAX_TOKENS)), "measured"
        else:
            rate, rate_source = default_rate_here(engine, spec.mode), "default"
        by_calls = trial_calls(spec, engine, sample.trial_lengths or sample.lengths, trials)
        work, what = by_calls or (tokens / rate, f"{tokens:,.0f} tokens at {rate:,.0f} tokens/s ({rate_source})")
        defaults += start_source.startswith("default") + (by_calls is None and rate_source == "default")
        each.append((start + work, f"{engine} {start:.1f} s start ({start_source}) + {what}"))
    last = trial_order(able)[-1]
    closing = 0.0 if kept else DEFAULT_TRIAL_CLOSE.get(last, default_exit(last))
    besides, source = stored(parts, trials_key(spec), trial_overhead_name(kept), 1.0 + closing)
    seconds = sum(s for s, _ in each) + besides
    text = "; ".join(t for _, t in each) + f"; besides the engines {besides:.1f} s ({source})"
    if defaults == 2 * len(each):
        return Part(name="engine trials", seconds=seconds, source="default: never measured here, each engine at "
                    "its defaults: " + text)
    return Part(name="engine trials", seconds=seconds, source=f"each engine from its parts at {mean:,.0f} tokens a "
                f"row: {text}" + (f" ({defaults} default figure{'s' if defaults > 1 else ''})" if defaults else ""))


def measured_start(spec: JobSpec, engine: str, parts: dict[str, Any], trials) -> tuple[float | None, str]:
    """The engine's start for this model and mode as measured here: the median of its trials' starts and
    its runs' (None when never measured)."""
    starts = [t.start_seconds for _, t in trials if t.engine == engine and t.start_seconds > 0
              and not t.estimated_from and not t.compiled]
    starts += parts.get(engine_key(spec, engine), {}).get("engine start", [])
    if not starts:
        return None, ""
    return statistics.median(starts), f"measured here, median of {len(starts)}"


def first_compile(spec: JobSpec, engine: str, parts: dict[str, Any], trials) -> tuple[float, str]:
    """The seconds a vLLM start spends compiling the model, where no start of this model and mode was measured
    here (a first start compiles; vLLM keeps the graphs for the next: tokenmill.vllm_engine.compiled_graphs),
    and what they are from. Starts that compiled are stored apart from those that loaded (COMPILING_START), so
    a later start is predicted from loads, not from a first start's compile."""
    if engine != "vllm":
        return 0.0, ""
    if any(t.engine == engine and t.start_seconds > 0 and not t.estimated_from for _, t in trials):
        return 0.0, ""
    if any(parts.get(engine_key(spec, engine), {}).get(name) for name in ("engine start", COMPILING_START)):
        return 0.0, ""
    if graphs_kept(resolve_model(spec.model_name), spec.mode):  # tokenmill's cache emptied, vLLM's kept
        return 0.0, "vLLM's cache holds the graphs an earlier start of this model compiled: it loads them"
    factor, speed = machine_speed()
    default = DEFAULT_VLLM_COMPILE[spec.mode]
    return default * factor, (f"its first start here compiles the model: + {default * factor:.1f} s (default: "
                              f"{default:g} s{speed})")


def trial_tokens(spec: JobSpec, lengths: list[int], engine: str) -> float:
    """The tokens an engine's trial computes (engine_choice.run_trial): a warm-up call, then the rest of the
    sample, twice for transformers embedding on a CPU (timed at two stream settings); generation's outputs
    at the trial's cap."""
    warm, timed = split_warm(lengths)
    out = min(spec.generation.max_tokens, TRIAL_MAX_TOKENS) if spec.mode == "generate" else 0
    passes = 2 if engine == "transformers" and spec.mode == "embed" and device_label().startswith("cpu") else 1
    return sum(n + out for n in warm) + passes * sum(n + out for n in timed)


def restart_part(spec: JobSpec, engine: str) -> Part:
    """The engine's start after its trial in this process closed it (engine_choice.RESTART_SECONDS), at this
    machine's speed (an engine with none: its first start's default). Stated, not measured by runs: their parts
    do not hold it apart yet (0.04 s against 4.9 s for MiniLM on transformers, timed in one process here)."""
    factor, why = machine_speed()
    default = restart_seconds(engine, default_start(engine, spec.mode))
    return Part(name="engine start", seconds=default * factor, source=(
        f"{engine}: started again after its trial closed it, its library imported: {default:g} s{why}"))


# A run's engine start where none ran here yet, as a share of its trial's start in the first run: the machine's
# first start of an engine reads its library and model from a cold disk cache, the later ones from memory. The
# transformers engine's first warm run (bench/PREDICTION.md, runs 28-39 on four hosts) started in 0.67-1.42 of its
# trial's start, median 0.91 of 14 (0.74 and 0.77 on the AVX2 EPYC of runs 39a-b, where 1.0 put that run +9.4% and
# +11.1% over): 0.9. Not measured for the others (vLLM's trial compiles on a first run: its start is no load's).
TRIAL_TO_RUN_START = {"transformers": 0.9}
# Where that trial was the engine's first start on the machine (no run here started it, for any model), its one
# reading, library and model read from a cold disk cache in whatever spell the host was in, is weighed with the
# engine's default start at this machine's speed: their geometric mean. Over the 44 bench reports that printed
# both (bench/PREDICTION.md, 2026-11 to 12-04, on four hosts), the warm job's engine start (transformers, MiniLM)
# read x0.9 of the trial missed by 0.96 s on average (0.63-1.81x the measured start; 12.3 s for 6.8 in run 47a,
# its trial 13.6 s where runs 45b-46b's took 6.0-7.3), the default 0.81 s (0.65-1.52x), their geometric mean
# 0.77 s (0.66-1.43x); that job's wall, recomputed on its rows, missed 10% in 15 reports on the trial, 14 on
# the mean (median |error| 6.3% against 4.4%). A later first start of one more model (SmolLM2's, after MiniLM's)
# reads the library from memory: its trial's start stands alone (0.6 s, its run's 0.5 s, against a default 4 s).


def started_here(parts: dict[str, Any], engine: str) -> bool:
    """Whether a run on this device started the engine, for any model or mode."""
    return any(values.get("engine start") for key, values in parts.items()
               if key.startswith(f"{device_label()}|{engine}|"))


def engine_start_part(spec: JobSpec, engine: str, sample: JobSample, parts: dict[str, Any], trials,
                      gate_makes: bool = False) -> Part:
    """The engine's start as runs here waited for it; before any run, as its trial measured it; and the
    models it makes first (ONNX Runtime's and OpenVINO's, once per machine), unless a gate before it makes them."""
    seconds, source = stored(parts, engine_key(spec, engine), "engine start", default_start(engine, spec.mode))
    loads = [(m, t) for m, t in trials if not t.compiled]  # a trial that compiled: this start loads its graphs
    if source.startswith("default") and any(t.engine == engine for _, t in loads):
        default_here, default_source = seconds, source.removeprefix("default: never measured here, ")
        share = TRIAL_TO_RUN_START.get(engine, 1.0)
        seconds = trial_start(spec, engine, sample, loads) * share
        source = f"its trial's start{f' x {share:g}' if share != 1.0 else ''}, no run here yet"
        if engine in TRIAL_TO_RUN_START and not started_here(parts, engine):
            source = (f"the geometric mean of its trial's start x {share:g}, {seconds:.1f} s (the engine's first "
                      f"start here, from a cold disk cache), and its default {default_source}, {default_here:.1f} s; "
                      "no run here yet")
            seconds = math.sqrt(seconds * default_here)
    elif source.startswith("default"):
        compiling, why = first_compile(spec, engine, parts, trials)
        if why:
            seconds, source = seconds + compiling, f"{source}; {why}"
    making, made = (0.0, "") if gate_makes else making_part(models_to_make(spec))
    if making:
        seconds, source = seconds + making, f"{source}; + {making:.1f} s making {made}"
    return Part(name="engine start", seconds=seconds, source=f"{engine}: {source}")


# Making a model ONNX Runtime or OpenVINO runs (tokenmill.onnx_models, tokenmill.openvino_models: once per machine;
# OpenVINO's int8 once per corpus, calibrated on its rows), where none of its kind was made here: seconds on the
# reference machine, x machine_speed. A 2-core AMD EPYC of speed ~2.2 (bench/PREDICTION.md's host) made ONNX
# Runtime's int8 of MiniLM in 4.0-5.1 s and OpenVINO's int8 (NNCF, ~16k calibration tokens) in 20-28 s; the 2-core
# EPYC with AVX-512 (2026-12-02, interpreter probe 11.7-12.1 ms, speed ~1.1) made the ONNX export in 1.6-1.9 s
# with torch and transformers imported (TORCH_IMPORT_SECONDS), the int8 copies in 1.6 s and 11.9-14.1 s. Where
# one was made here before (another version: other weights, libraries or corpus), its median seconds.
# OpenVINO's int8 over the machine's speed where it was made: 9.7, 10.8 and 10.3 s on the EPYC with AVX-512 (runs
# 37-38's first gates, speed 1.05-1.45), 10.3, 9.6 and 8.0 on a 2-core Zen 3 EPYC with AVX2 alone (runs 39a-b,
# `make run`'s first gate there; speed 1.56-1.94), where 11 put each over: median 10.
DEFAULT_MAKE_SECONDS = {"onnx fp32": 1.5, "onnx quantized": 2.0, "openvino quantized": 10.0}
# Making a model imports torch where nothing in the process has yet: the ONNX export (tokenmill.onnx_models._export)
# torch and transformers, OpenVINO's int8 NNCF (which imports torch); running ONNX Runtime or OpenVINO imports
# neither (their engines load a session). On that EPYC at speed ~1.1, in fresh processes: torch and transformers'
# imports 4.7-4.8 s, the whole export 6.1-6.8 s; `import nncf` 4.2 s. Run 37a of bench/PREDICTION.md, the first
# whose first gate made its models (an OpenVINO reference first), made the export in 6.3 s, predicted 0.9.
TORCH_IMPORT_SECONDS = 4.2
TORCH_ENGINES = ("transformers", "vllm", "auto")  # engines whose start (auto: its trials) imports torch


def engine_of(spec: JobSpec) -> str:
    """The engine the job's model runs on: as written, or the one engine auto can run it on here (a quantization
    only ONNX Runtime makes); auto otherwise."""
    if spec.model.engine != "auto":
        return spec.model.engine
    able = runnable_engines(spec)[0]
    return able[0] if len(able) == 1 else "auto"


def models_to_make(spec: JobSpec) -> list[tuple[str, str]]:
    """(kind, name) of each model the job's engine makes before it starts (an ONNX export, a quantized copy)
    that is not made here yet; [] for engines that make none, or where it cannot be told (the run says why)."""
    engine, quantization = engine_of(spec), spec.model.quantization
    if engine not in ("onnxruntime", "openvino") or spec.mode != "embed":
        return []
    try:
        model_path = resolve_model(spec.model_name)
        steps = onnx_steps(model_path, quantization if engine == "onnxruntime" else None, spec.model_name)
        out = [("onnx", name) for name, identity in steps
               if not (model_folder("onnx", name, identity) / "model.onnx").exists()]
        if engine == "openvino" and quantization:
            batches, digest = calibration(spec, model_path)
            exported = model_folder("onnx", *steps[0]) / "model.onnx"
            name, identity = openvino_step(exported, model_path, quantization, spec.model_name, digest, len(batches))
            if not (model_folder("openvino", name, identity) / "model.xml").exists():
                out.append(("openvino", name))
    except Exception:  # noqa: BLE001 - a model that cannot be located here: its engine's start reports why
        return []
    return out


def imports_torch(kind: str, name: str) -> bool:
    """Whether making this model imports torch (TORCH_IMPORT_SECONDS): the ONNX export, OpenVINO's int8."""
    return kind == "openvino" or name.endswith(".fp32")


def making_part(models: list[tuple[str, str]], torch_in: bool = False) -> tuple[float, str]:
    """The seconds making these models (in this order) takes here, and what each is from. A model never made
    here that imports torch (imports_torch) is charged the import where nothing imported torch before it in the
    process: neither another such making nor, where `torch_in`, anything before these."""
    seconds, says = 0.0, []
    factor, speed = machine_speed()
    for kind, name in models:
        before = made_seconds(kind, name)
        if before:
            each = statistics.median(before)
            says.append(f"{kind} {name} {each:.1f} s (made here before, median of {len(before)})")
        else:
            default = DEFAULT_MAKE_SECONDS[f"{kind} {'fp32' if name.endswith('.fp32') else 'quantized'}"]
            imports = TORCH_IMPORT_SECONDS if imports_torch(kind, name) and not torch_in else 0.0
            each = (default + imports) * factor
            says.append(f"{kind} {name} {each:.1f} s (default: never made here, {default:g} s" + (
                f" + {imports:g} s importing torch, which nothing before it here imports" if imports else "")
                + f"{speed})")
        torch_in = torch_in or imports_torch(kind, name)
        seconds += each
    return seconds, "; ".join(says)


def gate_making(spec: JobSpec, models: list[ModelSpec]) -> tuple[float, str]:
    """making_part for a gate's models, made at each one's engine start in the gate's order (the reference,
    then the candidates): a model made after one on an engine that imports torch (TORCH_ENGINES), or after a
    making that imports it, imports nothing more."""
    seconds, says, done = 0.0, [], set()
    torch_in = False
    for model in models:
        job = job_for(spec, model)
        new = [made for made in models_to_make(job) if made not in done]
        if new:
            each, said = making_part(new, torch_in)
            seconds, says, done = seconds + each, [*says, said], done | set(new)
        torch_in = (torch_in or engine_of(job) in TORCH_ENGINES
                    or any(imports_torch(kind, name) for kind, name in new))
    return seconds, "; ".join(says)


_made: dict[str, Prediction] = {}  # per job, for this process: the prediction its run is held to
# per gated job: its gate's key as predicted (with an implicit candidate, the job's model, which the gate changes)
_gate_keys: dict[str, str] = {}


def probe_machine(spec: JobSpec) -> None:
    """A first command's model probe (probe_speed), where predicting this job reads it and nothing here has
    probed or measured an engine yet; nothing otherwise (the stored figures read, milliseconds).
    `tokenmill run` calls it before Prefect's API starts, not beside it: on a 2-core EPYC the API's first start,
    creating its database, took 16.3 s beside the probe's 3.0 s in a fresh interpreter (bench/PREDICTION.md run
    34a) against 11.3-12.3 s without it (runs 33a-b), more than the probe's own seconds, and no default held it."""
    if spec.mode == "embed":
        compute_speed("embed")


def predict_job(spec: JobSpec, probe: bool = False) -> Prediction:
    """The one prediction of a job on this machine: `tokenmill plan`, `calibrate` and `run` call this.
    probe: `tokenmill run`'s, which measures a generation corpus's answers first where nothing here has
    (tokenmill.answer_probe), once the sample is read and the row cache's share estimated without its rows."""
    probe_machine(spec)  # before the parts that measure it
    if spec.gate is not None:
        prediction = predict_gated(spec)
    else:
        sample = job_sample(spec)
        if probe and sample.shards:
            engine, kept = probe_answers(spec, statistics.fmean(sample.trial_lengths or [1]))
            sample = sample.model_copy(update={"probe_engine": engine, "probe_kept": kept})
        prediction = predict(spec, sample, read_parts(), engine_trials(spec))
    prediction.track = track_record()
    _made[_job_key(spec)] = prediction
    return prediction


def predict_gated(spec: JobSpec) -> Prediction:
    """A job with an eval gate: the gate, then the corpus on the model it picks, which does not start beside
    the API (tasks/warm.py starts no engine before the gate). Where this machine kept a verdict on this job's
    sample and models, that verdict's model and a gate that starts no engine. Else the gate measures every
    model, and the corpus is predicted on the model this gate's last verdict here (on another corpus)
    picks when judged again at this corpus's lengths (judged_at), and before any, on the candidate it picks if
    it passes, the cheapest at the default rates (default_pick; the reference where none saves gate.min_saving
    at them), with what the reference would take instead (the part says which). Where the gate measures, the
    whole process on each model it may pick too (Prediction.branches), from the same figures: make run's gate on a
    2-core EPYC without VNNI failed both int8 candidates on the sample corpus (top-10 overlap 0.896 against 0.90)
    and the reference ran, 352 s against the 227 s predicted on ONNX Runtime's int8 and 327 s on the reference:
    so `tokenmill run` measures an embedding gate before it predicts (gate_ran_first, gate_first_part)."""
    first = gate_ran_first()
    verdict = known_verdict(spec)
    elsewhere = last_verdict_elsewhere(spec) if verdict is None else None
    picks = verdict or elsewhere
    assumed = default_pick(spec) if picks is None else None
    model = chosen_model(spec, picks) if picks is not None else assumed or spec.gate.reference
    corpus = job_for(spec, model)
    parts = read_parts()
    sample = job_sample(corpus)
    if elsewhere is not None:  # the last verdict judged again at this corpus's lengths: what it picks here
        picks = elsewhere = judged_at(spec, elsewhere, sample.lengths)
        picked = chosen_model(spec, picks)
        if picked != model:  # another model's sample: its row cache's share is its own
            model, corpus = picked, job_for(spec, picked)
            sample = job_sample(corpus)
    if verdict is None:  # a gate measured before this prediction kept its rows already: the row cache's share counts
        sample = sample.model_copy(update={"gate_kept": gate_kept_rows(spec, corpus, sample)})  # them (job_sample)
    rate = kept_rate(picks, "its gate's sample" if verdict is not None else "this gate's sample of another corpus")
    out = predict(corpus, sample, parts, engine_trials(corpus), early_start=False, gate_rate=rate,
                  gate_makes=verdict is None or bool(first))
    gate = gate_part(spec, corpus, verdict, elsewhere, sample, parts)
    if first and verdict is not None:
        gate = gate_first_part(first, gate)
    last = candidate_models(spec)[-1]

    def whole(run: Prediction, on: ModelSpec) -> Prediction:
        rest = run.parts[2:]
        if (verdict is None or first) and on == last:  # gate.measure leaves its last model's engine open
            rest = [Part(name="engine start", seconds=0.0, source=f"{on.engine}: kept open from the gate, its last "
                         "model") if p.name == "engine start" else p for p in rest]
        return run.model_copy(update={"parts": [*run.parts[:2], gate, *rest]})

    assumed_run = whole(out, model)
    branches = {}
    if verdict is None:  # the gate measures: each model it may pick, from the same figures
        for each in [spec.gate.reference, *candidate_models(spec)]:
            branch = assumed_run if each == model else whole(
                predict(job_for(spec, each), sample, parts, [], early_start=False, gate_makes=True), each)
            branches[branch_key(each)] = (model_label(job_for(spec, each)) + f" ({each.engine})", branch.seconds,
                                          getattr(branch.part("exit"), "seconds", 0.0))
    if assumed is not None:  # what the corpus would take on the reference, should no candidate pass
        on_reference = branches[branch_key(spec.gate.reference)][1]
        gate = gate.model_copy(update={"source": gate.source + (
            f" (if none passes, the reference runs the corpus: {on_reference - assumed_run.seconds:+,.0f} s)")})
        assumed_run = whole(out, model)  # with the gate part that says so
    _gate_keys[_job_key(spec)] = gate_key(spec)
    return assumed_run.model_copy(update={"branches": branches, "assumed": branch_key(model) if branches else ""})


def gate_ran_first() -> float:
    """The seconds of the eval gate this process measured before it predicted (tokenmill.gate.judge_first: a
    `tokenmill run`'s, between the command's start and its prediction); 0 where it did not. Its verdict is then
    kept here, and `plan` and `calibrate`, which measure no gate, predict from it, as from one `tokenmill gate`
    kept; before any, from the cheapest candidate assumed to pass (predict_gated)."""
    marks = timeline.marks()
    if not timeline.measures_process() or not marks.get("cli_ready", math.inf) <= marks.get(GATE_FIRST[0], 0.0):
        return 0.0
    return _span(marks, *GATE_FIRST)


def gate_first_part(seconds: float, kept: Part) -> Part:
    """The eval gate of a run that measured it before its prediction: those seconds, measured (the models it
    made within them), and the flow's gate after them, which finds that verdict kept (`kept`: gate_part's)."""
    marks = timeline.marks()
    made = _made_within(marks, *GATE_FIRST)
    making = f", {made:.1f} s of it making the models not made here yet" if made >= 0.05 else ""
    return Part(name="eval gate", seconds=seconds + kept.seconds, source=(
        f"{seconds:.1f} s before this prediction, no verdict here on this sample yet: every model measured on it "
        f"(tokenmill.gate.judge_first), measured{making}; then the flow's gate {kept.seconds:.1f} s, {kept.source}"))


def branch_key(model: ModelSpec) -> str:
    """A model a gate may pick, as Prediction.branches and the record (compare) name it."""
    return model.model_dump_json()


def judged_at(spec: JobSpec, report: GateReport, lengths: list[int]) -> GateReport:
    """A verdict on another corpus's sample judged again as if its sample had these rows' lengths: each model
    at its rate at them (as it timed its calls by length there, log-log between: rate_at; a model timed over
    its whole sample alone keeps that rate), its $/1M in proportion, its tokens as these rows'. A gate picks
    the cheapest model that passes on the corpus it runs, and the cheapest over another corpus's lengths need
    not be over these: int8 OpenVINO and ONNX Runtime on the bench's 2-core Xeon (run 20b) ran the mixed
    corpus's sample at 15,418 and 17,312 tokens/s, and OpenVINO rows of 240 tokens at 20,673; the long
    corpus's own gate picked OpenVINO. Pass or fail is the other corpus's: only a gate on this one tells."""
    if not lengths:
        return report

    def at(cost):
        curve = [(mean, rate) for mean, rate in cost.rates_by_length.values()]
        if not curve or cost.tokens_per_s <= 0:
            return cost
        rate = sum(lengths) / sum(n / rate_at(curve, n) for n in lengths)
        return cost.model_copy(update={"tokens_per_s": rate, "usd_per_1m_tokens": cost.usd_per_1m_tokens
                                       * cost.tokens_per_s / rate,
                                       "tokens": round(statistics.fmean(lengths) * report.sample_rows)})

    rungs = [v.model_copy(update={"cost": at(v.cost)}) for v in report.candidates]
    return GateReport.judge(spec, report.sample_source, report.sample_rows, at(report.reference),
                            rungs).model_copy(update={"cached": True})


def default_pick(spec: JobSpec) -> Any:
    """Before this gate's first verdict here: the candidate it picks if every candidate passes, by the rule
    of its verdicts (tokenmill.gate.pick_cheapest) on $/1M at the engines' default rates; None where none
    saves gate.min_saving at them (the reference runs)."""
    def cost(model) -> float:
        return 1.0 / default_rate(engine_of(job_for(spec, model)), spec.mode, model.quantization)

    reference, candidates = cost(spec.gate.reference), [cost(m) for m in candidate_models(spec)]
    chosen = pick_cheapest(dict(enumerate(candidates)),
                           {i: round(1 - c / reference, 9) for i, c in enumerate(candidates)}, spec.gate.min_saving)
    return None if chosen is None else candidate_models(spec)[chosen]


def gate_kept_rows(spec: JobSpec, corpus: JobSpec, sample: JobSample) -> int:
    """The corpus rows a gate that measures computes and keeps in the row cache for the corpus run
    (tokenmill.gate.run_sample: an embedding gate whose sample is the corpus's own rows, every model's rows
    kept, so the pick's are there whichever it is): the sample's rows, as many as the corpus has to compute."""
    if (spec.mode != "embed" or spec.gate.eval_file is not None or not corpus.cache.enabled
            or bypass_reason(corpus, corpus.model.engine) is not None or sample.finished_shards):
        return 0
    kept = min(spec.gate.sample_rows, sample.rows_to_compute(collapses(corpus, corpus.model.engine, sample)))
    return round(kept * (1.0 - sample.row_cache_share))  # rows the cache holds already: job_sample left them out


def kept_rate(verdict: GateReport | None, where: str) -> tuple[float, float, str] | None:
    """The corpus model's (mean tokens a row, tokens/s, where) on a gate's sample, from a kept verdict.
    Embedding only: a generation sample's tokens hold its answers, and its calls are priced by call_costs."""
    if verdict is None or verdict.mode != "embed":
        return None
    cost = verdict.candidates[verdict.chosen].cost if verdict.action == "candidate" else verdict.reference
    if cost.tokens <= 0 or cost.tokens_per_s <= 0 or verdict.sample_rows <= 0:
        return None
    return cost.tokens / verdict.sample_rows, cost.tokens_per_s, where


def gate_samples_seconds(verdict: GateReport, lengths: list[int], rows: int) -> float:
    """Every model the verdict ran, on `rows` sample rows of these lengths (the corpus's sample): at the rate
    it measured on its own sample at each length class there (log-log between them, as rate_at), else at its
    rate over that sample; and its untimed pass (gate.UNTIMED_PASS_MODE) as it measured it, over its timed one."""
    lengths = lengths or [1]
    seconds = 0.0
    for cost in [verdict.reference, *(v.cost for v in verdict.candidates)]:
        if cost.tokens <= 0 or cost.tokens_per_s <= 0:
            continue
        curve = [(mean, rate) for mean, rate in cost.rates_by_length.values()] or [(1.0, cost.tokens_per_s)]
        timed = rows * statistics.fmean(n / rate_at(curve, n) for n in lengths)
        seconds += timed * (1 + (cost.untimed_seconds / cost.seconds if cost.seconds > 0 else 0.0))
    return seconds


def gate_part(spec: JobSpec, corpus: JobSpec, verdict: GateReport | None, elsewhere: GateReport | None,
              sample: JobSample, parts: dict[str, Any]) -> Part:
    """The eval gate's seconds. A verdict kept on this sample: as such gates measured here. Else the gate
    measures: what its gates here spent besides the models' samples, plus this sample's tokens at each
    model's rate in this gate's last verdict here; before that, as gates of these models and sample size
    measured here; never measured: each model's default start and the sample's tokens at its default rate."""
    ran_on = f"the corpus on {corpus.model.name} ({corpus.model.engine})"
    key = gate_key(spec)
    if verdict is not None:
        seconds, source = stored(parts, key, GATE_KEPT, GATE_VERDICT_KEPT_SECONDS)
        return Part(name="eval gate", seconds=seconds, source=(
            f"{source}; this machine's verdict on this sample kept ({verdict.action}): {ran_on}"))
    why = (f"no verdict here on this sample yet: {ran_on}, " + (
        f"as this gate's last verdict here (another corpus), judged again at this corpus's lengths, picks "
        f"({elsewhere.action})" if elsewhere is not None
        else "the reference, as the gate runs it when no candidate passes and saves gate.min_saving (one that "
             "does runs the corpus in less)" if corpus.model == spec.gate.reference
        else "the cheapest candidate at the engines' default rates, as the gate picks it if it passes"))
    corpus_rows = sample.rows_read if not sample.finished_shards else spec.gate.sample_rows  # a re-run: still sampled
    gate_rows = min(spec.gate.sample_rows, max(corpus_rows, 1))
    tokens = statistics.fmean(sample.lengths or [1]) * gate_rows
    models = [spec.gate.reference, *candidate_models(spec)]
    making, made = gate_making(spec, models)
    if making:
        why += f"; + {making:.1f} s making the models not made here yet: {made}"
    besides, source = stored(parts, key, GATE_BESIDES, None)
    if besides is not None and elsewhere is not None:
        samples = gate_samples_seconds(elsewhere, sample.lengths, gate_rows)
        return Part(name="eval gate", seconds=besides + samples + making, source=(
            f"{besides:.1f} s besides the models' samples ({source}) + {samples:.1f} s for ~{tokens:,.0f} sample "
            f"tokens at each model's rates in its last verdict here (by length, where it timed its calls); {why}"))
    seconds, source = stored(parts, key, GATE_MEASURED, None)
    if seconds is not None:
        return Part(name="eval gate", seconds=seconds + making, source=f"{source}; {why}")
    engines = [engine_of(job_for(spec, m)) for m in models]
    passes = 2 if spec.mode == UNTIMED_PASS_MODE else 1  # gate.run_sample: an untimed pass, then the timed one
    each = [default_start_here(e, spec.mode) + passes * tokens / default_rate_here(e, spec.mode, m.quantization)
            for e, m in zip(engines, models)]
    factor, speed = machine_speed()
    return Part(name="eval gate", seconds=sum(each) + GATE_BESIDES_SECONDS * factor + making, source=(
        f"default: never measured here, {len(models)} models each at its engine's default start and rate on "
        f"~{tokens:,.0f} sample tokens{' twice (untimed, then timed)' if passes > 1 else ''}, "
        f"+ {GATE_BESIDES_SECONDS:g} s{speed}; {why}"))


def made_for(spec: JobSpec) -> Prediction | None:
    """The prediction this process made for this job before running it, if it made one."""
    return _made.get(_job_key(spec))


def _job_key(spec: JobSpec) -> str:
    """A job's identity for its prediction; with an eval gate the gate, not the model (which the gate picks,
    after the prediction: the run is held to it whichever model ran)."""
    chooses = "gate" if spec.gate is not None else "model"
    return spec.model_dump_json(include={"input", "output", chooses, "mode", "batching", "generation"})


# ---- afterwards: what the run measured -----------------------------------------------------------------

def _span(marks: dict[str, float], start: str, end: str) -> float:
    return max(marks[end] - marks[start], 0.0) if start in marks and end in marks else 0.0


def measured_parts(spec: JobSpec, engine: str, metrics: dict[str, float], engine_rows: int,
                   trials_ran: bool, rows_read: int | None = None,
                   trial_engine_seconds: float = 0.0, shards_read: int = 0,
                   gate_samples: float | None = None,
                   lengths: list[call_costs.CallCost] = (), shards_finished: int = 0) -> dict[str, dict[str, float]]:
    """This run's parts, by the cache key each is stored under (see `predict`). trial_engine_seconds: the
    trials' engines' whole trials (each engine's `wall_seconds`), when this run paid for trials;
    gate_samples: the seconds its eval gate's models spent on their timed samples, when it measured them;
    shards_read: the shards it ran (each a task: PER_SHARD_SECONDS of its overhead is theirs, not the rows');
    shards_finished: those the output already held (each a task that reads its result back: FINISHED_SHARD)."""
    marks = {"process": timeline.process_started(), **timeline.marks()}
    if not timeline.measures_process() or not {"cli_ready", "tracking_warm", "flow_called"} <= set(marks):
        return {}
    # tasks/warm.py: before a first trial the main thread waits for the API; the engine starts ahead of the flow
    trials = _span(marks, "engine_choice_start", "engine_choice_done") if trials_ran else 0.0
    waited = _span(marks, "api_wait", "engine_choice_start") if trials_ran else 0.0
    early = _span(marks, "early_engine_start", "early_engine_ready")
    fixed = _process_parts(marks, trials_ran, trials + waited + early)
    out = {fixed_key(spec, engine): fixed, **_machine_parts(spec, marks, alone=_no_engine_before(marks, trials_ran))}
    gate = _span(marks, "gate_start", "gate_verdict_kept" if "gate_verdict_kept" in marks else "gate_measured")
    if gate or _before_prediction(marks, *GATE_FIRST):
        out.update(_gate_parts(spec, marks, gate_samples))
    if "first_engine_call" not in marks:  # every shard finished before: the process's parts, no engine's
        if shards_finished and "shards_start" in marks and "shards_done" in marks:
            out.setdefault(machine_key(), {})[FINISHED_SHARD] = _span(marks, "shards_start", "shards_done") / shards_finished
        return out
    prepare, in_shard = _first_shard(marks, early)
    index = _span(marks, "index_start", "index_done")
    # not the engine's start either, where it started in the first shard (the prediction's "engine start")
    # nor the finished shards' tasks ahead of the first that computes (a resumed run's: "finished shards")
    before = _span(marks, "shards_start", "first_shard_started") if shards_finished else 0.0
    fixed["flow start"] = _span(marks, "flow_called", "first_engine_call") - prepare - gate - in_shard - before
    fixed["finish"] = _span(marks, "shards_done", "record_started") - index
    engine_seconds, engine_tokens = metrics.get("engine_seconds", 0.0), metrics.get("engine_tokens", 0.0)
    rows_read = rows_read if rows_read is not None else engine_rows
    if rows_read > 0 and "shards_done" in marks:
        outside = _span(marks, "first_engine_call", "shards_done") + prepare - engine_seconds
        outside = max(outside - PER_SHARD_SECONDS * machine_speed()[0] * shards_read, 0.0) / rows_read * 1000
        fixed[OVERHEAD] = outside  # reading, tokenizing, writing: it grows with the rows' length, so by length too
        if engine_rows > 0 and engine_tokens > 0:
            mean = max((engine_tokens - metrics.get("output_tokens", 0.0)) / engine_rows, 1.0)
            fixed[f"{OVERHEAD}@{length_class(mean)}"] = outside
            made = made_for(spec)
            if made is not None and made.chars_per_row:  # the text it read and tokenized a row, beside it
                fixed[f"{OVERHEAD_CHARS}@{length_class(mean)}"] = made.chars_per_row
    if index and engine_rows > 0:
        fixed["index build per 1,000 rows"] = index / engine_rows * 1000
    _add_rate_parts(out, spec, engine, metrics, engine_rows, lengths)
    if trials_ran:
        if trial_engine_seconds:
            kept = engine == trial_order(runnable_engines(spec)[0])[-1]  # what the trials cost besides the engines: the sample's reading, closing them
            out[trials_key(spec)] = {trial_overhead_name(kept): trials - trial_engine_seconds}
    elif early or "engine_start" in marks:
        span = ("early_engine_start", "early_engine_ready") if early else ("engine_start", "engine_ready")
        name = COMPILING_START if "engine_compiled" in marks else "engine start"  # see first_compile
        out[engine_key(spec, engine)] = {name: max(_span(marks, *span) - _made_within(marks, *span), 0.0)}
    return out


def _process_parts(marks: dict[str, float], trials_ran: bool, elsewhere: float) -> dict[str, float]:
    """The parts every command's run has, an engine's or not: its imports, the API's start (not one that created
    its database: _machine_parts), and the main thread's own work besides what it did elsewhere (trials, the
    wait for the API before them, the early engine start) and the parts measured apart (main_thread_parts).
    With a trial, the main thread's work ran beside less of the API's start: stored apart (MAIN_BESIDE_TRIAL);
    no engine starting beside it, apart too (MAIN_ALONE; in the machine's first run, MAIN_FIRST_ALONE)."""
    main = (_span(marks, "cli_ready", "tracking_warm") - elsewhere - _reading(marks) - _tracking(marks)[1]
            - _span(marks, "sample_corpus_start", "sample_corpus_written")
            - _span(marks, "answer_probe_start", "answer_probe_done") - _model_probe(marks)
            - _before_prediction(marks, *GATE_FIRST))
    api = {} if "api_store_created" in marks else {"orchestrator API": _span(marks, "api_start", "api_ready")}
    return {"python imports": _span(marks, "process", "cli_ready"), **api,
            (MAIN_BESIDE_TRIAL if trials_ran else MAIN if not _no_engine_before(marks, trials_ran)
             else MAIN_FIRST_ALONE if "api_store_created" in marks else MAIN_ALONE): main}


def _no_engine_before(marks: dict[str, float], trials_ran: bool) -> bool:
    """Whether no engine started on the main thread before the flow (no trials, no early start: a gated job's run,
    a rerun's with nothing left to compute): its main thread's work (MAIN_ALONE) and MLflow's opening
    (TRACKING_ALONE) are stored apart."""
    return not trials_ran and "early_engine_start" not in marks


def _machine_parts(spec: JobSpec, marks: dict[str, float], alone: bool = False) -> dict[str, dict[str, float]]:
    """The parts any job's run measures for the next on this machine: the sample's reading (beside the tokens it
    read), MLflow's store opened (`alone`: with no engine started before it, TRACKING_ALONE) or created, the API's
    start that created its database and that start but its startup (API_FIRST_REST) or a later startup
    (API_STARTUP), the interpreter probe's milliseconds (machine_speed)."""
    out: dict[str, dict[str, float]] = {}
    reading, made = _reading(marks), made_for(spec)
    if reading and made is not None and made.read_tokens:  # the tokens its prediction's sample read
        out[reading_key(spec.mode)] = {READING: reading, READ_TOKENS: float(made.read_tokens),
                                       **({READ_CHARS: float(made.read_chars)} if made.read_chars else {})}
    machine = {}
    name, seconds = _tracking(marks)
    if name == TRACKING_CREATED:
        machine[name] = seconds
    elif name:
        machine[f"{TRACKING_ALONE if alone else name}@{spec.mode}"] = seconds
    startup = _span(marks, "api_startup_start", "api_startup_done") if "api_startup_done" in marks else None
    if "api_store_created" in marks:  # a first start here, apart from the API's later ones
        machine[API_CREATED] = _span(marks, "api_start", "api_ready")
        if startup is not None:  # the server's process marked its startup: the creating, and the rest apart
            machine[API_FIRST_REST] = max(machine[API_CREATED] - startup, 0.0)
    elif startup is not None:
        machine[API_STARTUP] = startup
    probed = command_interpreter_ms()
    if probed is not None:
        machine[INTERPRETER] = probed
    imports = command_imports_seconds()
    if imports is not None:
        machine[IMPORTS] = imports
    if machine:
        out[machine_key()] = machine
    return out


def _tracking(marks: dict[str, float]) -> tuple[str | None, float]:
    """(TRACKING_CREATED or TRACKING_OPENED, its seconds) where the main thread opened MLflow's store."""
    for end, name in (("tracking_created", TRACKING_CREATED), ("tracking_opened", TRACKING_OPENED)):
        if end in marks:
            return name, _span(marks, "tracking_open_start", end)
    return None, 0.0


def _first_shard(marks: dict[str, float], early: float) -> tuple[float, float]:
    """(the first shard's preparing: reading, tokenizing; the engine's start inside it): an engine that did not
    start early (a gated job's) starts in the first shard, and its start is its own part, not the shard's."""
    prepare = _span(marks, "first_shard_started", "first_engine_call")
    if early or marks.get("engine_start", 0.0) < marks.get("first_shard_started", math.inf):
        return prepare, 0.0
    in_shard = _span(marks, "engine_start", "engine_ready")
    return prepare - in_shard, in_shard


def _before_prediction(marks: dict[str, float], start: str, end: str) -> float:
    """A span of the main thread's that began between the command's start and the warm tracking store (the
    prediction's work, not a later job's or step's); 0 elsewhere."""
    if not marks.get("cli_ready", math.inf) <= marks.get(start, 0.0) <= marks["tracking_warm"]:
        return 0.0
    return _span(marks, start, end)


def _model_probe(marks: dict[str, float]) -> float:
    """The model probe's seconds (MODEL_PROBE_PART), where this process ran it for its prediction."""
    return _before_prediction(marks, "model_probe_start", "model_probe_done")


def _reading(marks: dict[str, float]) -> float:
    """The prediction's reading of the job's sample on the main thread (READING), where this process's first
    sample was read there (between the command's start and the warm tracking store)."""
    return _before_prediction(marks, "sample_read_start", "sample_read_done")


def _gate_parts(spec: JobSpec, marks: dict[str, float], gate_samples: float | None) -> dict[str, dict[str, float]]:
    """The eval gate's seconds (flows/batch.py marks its span), under the key its prediction read; without
    the models it made once per machine; and, where it measured, its seconds besides its models' samples.
    A run that measured its gate before its prediction (GATE_FIRST): that gate's, and its flow's, which found
    the verdict kept."""
    parts: dict[str, float] = {}
    if "gate_start" in marks:
        kept = "gate_verdict_kept" in marks
        end = "gate_verdict_kept" if kept else "gate_measured"
        parts[GATE_KEPT if kept else GATE_MEASURED] = max(_span(marks, "gate_start", end)
                                                          - _made_within(marks, "gate_start", end), 0.0)
    if _before_prediction(marks, *GATE_FIRST):
        parts[GATE_MEASURED] = max(_span(marks, *GATE_FIRST) - _made_within(marks, *GATE_FIRST), 0.0)
    if GATE_MEASURED in parts and gate_samples is not None:  # the models' starts, the metrics
        parts[GATE_BESIDES] = parts[GATE_MEASURED] - gate_samples
    return {_gate_keys.get(_job_key(spec)) or gate_key(spec): parts}


def _add_rate_parts(out: dict[str, dict[str, float]], spec: JobSpec, engine: str, metrics: dict[str, float],
                    engine_rows: int, lengths: list[call_costs.CallCost] = ()) -> None:
    """The engine's tokens/s at this run's length class, and how far below its default rate it ran
    (compute_speed), where the run computed rows. Embedding calls timed one at a time (`lengths`:
    call_costs.take_lengths) give a rate at each length class that took a share of the engine's seconds:
    a corpus of short and long rows measures both lengths' rates, not one rate at a mean length no row has
    (OpenVINO's int8 MiniLM: 48,000 tokens/s on rows of 16, 36,000 on rows of 256, 33,600 over the mixed
    corpus's mean of 55)."""
    engine_seconds, engine_tokens = metrics.get("engine_seconds", 0.0), metrics.get("engine_tokens", 0.0)
    if engine_rows <= 0 or engine_seconds <= 0 or engine_tokens <= 0:
        return
    mean_in = max((engine_tokens - metrics.get("output_tokens", 0.0)) / engine_rows, 1.0)
    by_class = class_rates(lengths)
    if by_class:
        out[rates_key(spec, engine)] = {name: value for c, (mean, rate) in by_class.items()
                                        for name, value in ((f"tokens_per_s@{c}", rate), (f"mean_tokens@{c}", mean))}
    else:
        out[rates_key(spec, engine)] = {f"tokens_per_s@{length_class(mean_in)}": engine_tokens / engine_seconds,
                                        f"mean_tokens@{length_class(mean_in)}": mean_in}
    if measured_default(engine, spec.mode, spec.model.quantization):
        out.setdefault(machine_key(), {})[compute_key(spec.mode, spec.model.quantization, engine)] = (
            engine_tokens / engine_seconds)


def _made_within(marks: dict[str, float], start: str, end: str) -> float:
    """The seconds of this span that went to making models (tokenmill.onnx_models.MADE_SPANS)."""
    if start not in marks or end not in marks:
        return 0.0
    return sum(max(min(stop, marks[end]) - max(begin, marks[start]), 0.0) for begin, stop in MADE_SPANS)


def compare(prediction: Prediction, metrics: dict[str, float], ran: ModelSpec | None = None) -> dict[str, float]:
    """Prediction beside measurement, as run metrics. The record is written before the process exits, so
    the measured wall runs to the record's start and is held against the prediction less its exit part.
    ran: the model a gated job's corpus ran on; where the gate picked another than the prediction assumed, the
    branch predicted for it (Prediction.branches) beside the measured wall too, as `..._as_gated`."""
    out = prediction.metrics()
    wall = metrics.get("process_seconds")
    if not wall:
        return out
    branch = prediction.branches.get(branch_key(ran)) if ran is not None else None
    if branch is not None and branch_key(ran) != prediction.assumed:
        out.update(predicted_wall_seconds_as_gated=branch[1],
                   wall_prediction_error_as_gated=(branch[1] - branch[2]) / wall - 1.0)
    to_record = prediction.seconds - out["predicted_exit_seconds"]
    engine = metrics.get("engine_seconds", 0.0)
    out.update(measured_wall_seconds=wall, predicted_wall_seconds_to_record=to_record,
               wall_prediction_error=to_record / wall - 1.0, measured_engine_seconds=engine,
               measured_fixed_seconds=wall - engine,
               predicted_fixed_seconds_to_record=to_record - prediction.engine_seconds)
    if engine:
        out["engine_seconds_prediction_error"] = prediction.engine_seconds / engine - 1.0
    return out


# Each run's measured wall (to its record) over its prediction, under machine_key(): the last TRACK_KEEP, whatever the
# job. Never read into a prediction (no factor from another job): told beside it, so that a plan knows how far this
# machine's predictions have held (track_record).
TRACK = "measured wall over predicted, to the record"
TRACK_KEEP = 20


def remember_track(compared: dict[str, float]) -> None:
    """A run's prediction held against its measurement (compare's metrics), kept for track_record."""
    predicted, measured = compared.get("predicted_wall_seconds_to_record"), compared.get("measured_wall_seconds")
    if predicted and measured and predicted > 0:
        remember_parts({machine_key(): {TRACK: measured / predicted}}, keep=TRACK_KEEP)


def track_record() -> str:
    """How this machine's last runs (as commands, any job) came out against the predictions they printed: a line
    printed under every prediction, so that a plan sized on it knows how far to trust it here."""
    ratios = read_parts().get(machine_key(), {}).get(TRACK) or []
    if not ratios:
        return "On this machine no run has been held against its prediction yet."
    errors = sorted(r - 1.0 for r in ratios)
    within = sum(abs(e) <= 0.10 for e in errors)

    def said(error: float) -> str:
        return f"{abs(error):.0%} {'over' if error > 0 else 'under'}"

    if len(errors) == 1:
        return f"On this machine the last run ran {said(errors[0])} its prediction (wall to the run's record, measured against predicted)."
    return (f"On this machine the last {len(errors)} runs ran from {said(errors[0])} to {said(errors[-1])} their "
            f"predictions ({within} of {len(errors)} within 10%, median |error| "
            f"{statistics.median(abs(e) for e in errors):.0%}; wall to each run's record, measured against predicted).")


_exit_from: list[tuple[str, float, str]] = []  # (parts key, record's start, part name): the exit to measure


def remember_run(spec: JobSpec, engine: str, metrics: dict[str, float], engine_rows: int,
                 trials_ran: bool, rows_read: int | None = None, trial_engine_seconds: float = 0.0,
                 shards_read: int = 0, gate_samples: float | None = None, shards_finished: int = 0) -> None:
    """Store this run's measured parts for the next prediction of any job on this engine here."""
    remember_parts(measured_parts(spec, engine, metrics, engine_rows, trials_ran, rows_read, trial_engine_seconds,
                                  shards_read, gate_samples, call_costs.take_lengths(spec, engine), shards_finished))
    call_costs.remember_calls(cache_dir(), rates_key(spec, engine), call_costs.take(spec, engine))
    if spec.mode == "generate":  # the next prediction of this corpus and prompt reads how long its answers ran
        answers, prompts = call_costs.take_answers(spec, engine)
        call_costs.remember_answers(cache_dir(), answers_key(spec), answers, spec.generation.max_tokens, "run", prompts)
    marks = timeline.marks()  # the flow forgets them when it ends (timeline.reset)
    if timeline.measures_process() and "cli_ready" in marks and "record_started" in marks:
        opened = trials_ran or any(m in marks for m in ("engine_start", "early_engine_start", "answer_probe_start"))
        measured = "gate_measured" in marks or GATE_FIRST[1] in marks  # its models' engines open to the exit
        name = GATE_EXIT if measured else "exit" if opened else IDLE_EXIT
        _exit_from[:] = [(fixed_key(spec, engine), marks["record_started"], name)]


def remember_exit() -> None:
    """The command's last step: the seconds from the record's start to the process's end, its exit part."""
    if _exit_from:
        key, started, name = _exit_from.pop()
        remember_parts({key: {name: time.time() - started}})
