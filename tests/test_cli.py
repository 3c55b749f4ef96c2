"""`tokenmill` as a user runs it: a separate process, exit codes, what it prints."""

import os
import subprocess
import sys

import pyarrow.parquet as pq


def tokenmill(*args, cwd, timeout=600):
    env = dict(os.environ, PREFECT_HOME=str(cwd / ".prefect"))
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_print_spec_shows_the_resolved_job(tmp_path):
    done = tokenmill("run", "--print-spec", "--mode", "generate", "--set", "generation.temperature=0.5", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "mode: generate" in done.stdout and "temperature: 0.5" in done.stdout


def test_a_missing_input_is_a_clear_error_without_a_traceback(tmp_path):
    done = tokenmill("run", "--input", str(tmp_path / "nowhere"), "--output", str(tmp_path / "o"), "--no-progress",
                     cwd=tmp_path)
    assert done.returncode == 2
    assert "tokenmill: error:" in done.stderr and "nowhere: no such file or directory" in done.stderr
    assert "Traceback" not in done.stderr.split("tokenmill: error:")[-1]


def test_the_cli_turns_off_mlflows_telemetry_and_vllms_usage_report():
    """Both are on by default and reach for the internet (a job's MLflow run opening was caught waiting on the
    telemetry's config fetch). Read as the libraries read them, in a process whose environment names neither
    and is not a test or CI's (MLflow turns its telemetry off there by itself)."""
    quiet = ("MLFLOW_DISABLE_TELEMETRY", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "DO_NOT_TRACK",
             "PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS")
    env = {k: v for k, v in os.environ.items() if k not in quiet}
    probe = ("from tokenmill.cli import apply_cli_environment; apply_cli_environment(); "
             "from mlflow.telemetry.utils import is_telemetry_disabled; "
             "from vllm.usage.usage_lib import is_usage_stats_enabled; "
             "print(is_telemetry_disabled(), is_usage_stats_enabled())")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


def test_sample_corpus_is_realistic(tmp_path):
    done = tokenmill("sample-corpus", str(tmp_path / "corpus"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    files = sorted((tmp_path / "corpus").glob("*.parquet"))
    assert len(files) >= 3 and all(pq.ParquetFile(f).metadata.num_row_groups >= 3 for f in files)
    texts = pq.read_table(tmp_path / "corpus").column("text").to_pylist()
    assert len(texts) >= 20_000
    words = sorted(len(t.split()) for t in texts)
    median, p99 = words[len(words) // 2], words[int(len(words) * 0.99)]
    assert median < 60 and p99 > 8 * median  # many short documents, a long tail
    assert len(set(texts)) > 0.75 * len(texts)


def test_the_flags_are_the_job_specs_fields():
    """A flag per one-value field (--<dotted path>, its type, choices and description), and the short
    flags the CLI had before keep their fields."""
    import pytest

    from tokenmill.cli import FLAG_ALIASES, build_parser, spec_from_args
    from tokenmill.spec import ModelSpec
    from tokenmill.spec_fields import spec_fields
    from tokenmill.tasks.job import PrefectJob

    parser = build_parser()
    run = parser._subparsers._group_actions[0].choices["run"]
    flags = set(run._option_string_actions)
    for field in spec_fields(PrefectJob):
        flag = f"--{field.path.replace('_', '-')}"
        if field.scalar() is not None:
            assert flag in flags, field.path
        else:  # lists, mappings and sections: --set (`--model` is model.name's short flag)
            assert flag not in flags or field.path in FLAG_ALIASES, field.path
    before = ["input", "output", "format", "output_format", "mode", "model", "engine", "id_column", "text_column",
              "overlong", "max_tokens", "token_budget", "max_batch_size", "max_shard_rows", "tracking_uri",
              "experiment", "dispatch", "workers", "deployment"]
    assert {f"--{flag.replace('_', '-')}" for flag in before} <= flags and set(FLAG_ALIASES) <= set(before)
    assert ModelSpec.model_fields["engine"].description.split(":")[0] in run.format_help()

    spec = spec_from_args(parser.parse_args([
        "run", "--engine", "transformers", "--model", "all-MiniLM-L6-v2", "--token-budget", "4096",
        "--batching.max-batch-size", "8", "--generation.temperature", "0.5", "--tracking-uri", "sqlite:///x.db",
        "--workers", "2", "--openai-batch.mixed-endpoints", "--pricing.gpu-count", "2", "--overlong", "reject"]))
    assert (spec.model.engine, spec.model.name, spec.batching.token_budget, spec.batching.max_batch_size) == (
        "transformers", "all-MiniLM-L6-v2", 4096, 8)
    assert spec.generation.temperature == 0.5 and spec.tracking.mlflow_tracking_uri == "sqlite:///x.db"
    assert spec.fleet.workers == 2 and spec.openai_batch.mixed_endpoints and spec.pricing.gpu_count == 2
    assert spec_from_args(parser.parse_args(["run"])) == PrefectJob()  # an unset flag leaves the default
    with pytest.raises(SystemExit):  # choices come from the field's Literal
        parser.parse_args(["run", "--engine", "tensorrt"])
    plan = parser.parse_args(["plan", "--window", "2h", "--calibration", "c.json"])  # plan's own flag
    assert plan.calibration == "c.json" and spec_from_args(plan).calibration is None


def test_a_command_called_inside_an_engine_scope_leaves_its_engines_to_the_scope(tmp_path, monkeypatch):
    """main() closes what engines a command left, so none is torn down by the interpreter's exit; but a caller
    that holds an engine_scope around it (a notebook, a worker, this test session) keeps its engines until its
    scope ends, and no later call starts them again."""
    from tokenmill import engines
    from tokenmill.cli import main

    class Held:
        closed = 0

        def close(self):
            Held.closed += 1

    monkeypatch.setattr(engines, "_engines", {("held",): Held()})  # the process's engines, this test's alone
    monkeypatch.setattr(engines, "_scope_depth", 0)  # not the session's scope: this test's is the outermost
    with engines.engine_scope():
        assert main(["spec-docs", "--out", str(tmp_path / "spec.md")]) == 0
        assert Held.closed == 0 and ("held",) in engines._engines
    assert Held.closed == 1 and not engines._engines  # the scope closed it when it ended
    monkeypatch.setattr(engines, "_engines", {("held",): Held()})
    assert engines._scope_depth == 0  # no scope held (a shell's `tokenmill`): main closes it
    assert main(["spec-docs", "--out", str(tmp_path / "spec.md")]) == 0
    assert Held.closed == 2 and not engines._engines
