"""Engines end with the flow that started them, and every command exits 0 after success.

These run as separate processes, as a user runs them: the failure they guard against
(vLLM torn down by the interpreter's exit, aborting a job that had succeeded with exit
134) only shows in a process that ends. Here: `tokenmill run` of a gated job embedding on vLLM (the gate's
transformers reference closed mid-command, its vLLM candidate then running the corpus), every engine's end checked
by its last exit hook. (`tokenmill gate` ran apart with a vLLM reference until the gate's engines ran in this one
process: a vLLM start less, ~100 s of CI; both end engines by the same close and exit through the same command().)
Elsewhere, where tests run
a command to its end anyway (conftest.assert_clean_exit): an OpenAI Batch job's idle rerun in
tests/test_openai_batch.py, and `tokenmill run` on transformers in tests/test_resume.py (a killed run's resume;
an idle rerun; two at once) and tests/test_prediction.py (with `calibrate` and `plan`). `calibrate` on vLLM does
not run to its end in a test: it ends its engine by the same engine_scope as a run and exits through the same
command() as every command (a third vLLM process here cost ~105 s of CI).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import TEXTS, assert_clean_exit, write_parquet
from tokenmill.engines import open_engines


def environment(cwd):
    return dict(os.environ, PREFECT_HOME=str(cwd / ".prefect"), PYTHONUNBUFFERED="1")


def tokenmill(*args, cwd, timeout=900):
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], cwd=cwd, env=environment(cwd),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def corpus(tmp_path):
    return write_parquet(tmp_path / "docs.parquet", [f"d{i}" for i in range(len(TEXTS))], TEXTS)


@pytest.mark.engine
def test_tokenmill_run_closes_its_vllm_engine_and_exits_0(tmp_path, corpus):
    """`tokenmill run` (the command's own exit path, tokenmill.cli.command) of a gated job on vLLM: the gate's
    reference (transformers) closed before its candidate (vLLM) starts, the candidate passing and running the
    corpus; when the command's last exit hook has run, no engine, no engine process and no vLLM client thread is
    left, nor a shared-memory segment the engine made; then it exits 0, cleanly."""
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        input: {corpus}
        output: {tmp_path / 'out'}
        model: {{name: all-MiniLM-L6-v2, engine: vllm, engine_kwargs: {{gpu_memory_utilization: 0.1, enforce_eager: true}}}}
        tracking: {{mlflow_tracking_uri: "sqlite:///{tmp_path}/mlflow.db"}}
        gate:
          reference: {{name: all-MiniLM-L6-v2, engine: transformers}}
          sample_rows: 8
    """))
    script = textwrap.dedent(f"""
        import atexit, json, os, sys, threading
        import psutil
        import tokenmill.engines as engines
        from tokenmill.engines import open_engines
        from tokenmill.vllm_engine import DEATH_WATCH_THREAD, VLLM_CLIENT_THREADS

        seen = {{}}
        real_start = engines.start_engine

        def named_vllm(process):  # vLLM names its processes (setproctitle): VLLM::EngineCore, VLLM::Worker
            try:
                return "VLLM" in " ".join(process.cmdline()) + process.name()
            except psutil.Error:  # ended since it was listed, or a zombie not reaped yet: no engine process
                return False

        def running(pid):
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:  # ended (and reaped) since it was seen
                return False

        def start_and_note(model_path, job):
            seen.setdefault("open_at_start", []).append(len(open_engines()))
            engine = real_start(model_path, job)
            seen.setdefault("started", []).append(job.model.engine)
            if job.model.engine == "vllm":
                seen["children"] = [p.pid for p in psutil.Process().children(recursive=True) if named_vllm(p)]
                seen["segments"] = sorted(engine.leftovers.segments)
            return engine

        def inspect():  # the last exit hook the command runs (registered first), before its os._exit
            alive = [p for p in seen.get("children", []) if running(p)]
            print("RESULT " + json.dumps({{
                "started": seen.get("started", []),
                "open_at_start": seen.get("open_at_start", []),
                "engines": len(open_engines()),
                "engine_processes_seen": len(seen.get("children", [])),
                "engine_processes_alive": alive,
                "client_threads": [t.name for t in threading.enumerate()
                                   if t.name in (*VLLM_CLIENT_THREADS, DEATH_WATCH_THREAD)],
                "segments_seen": seen.get("segments", []),
                "segments_left": [s for s in seen.get("segments", []) if os.path.exists("/dev/shm/" + s)],
            }}), flush=True)

        if __name__ == "__main__":
            engines.start_engine = start_and_note
            atexit.register(inspect)
            from tokenmill.cli import command

            sys.argv = ["tokenmill", "run", "--config", {str(job)!r}, "--no-progress"]
            command()
    """)
    (tmp_path / "run_then_inspect.py").write_text(script)
    done = subprocess.run([sys.executable, "run_then_inspect.py"], cwd=tmp_path, env=environment(tmp_path),
                          capture_output=True, text=True, timeout=900)
    assert_clean_exit(done, "tokenmill run on vLLM")
    assert f"{len(TEXTS)} in = {len(TEXTS)} out + 0 rejected" in done.stdout
    assert "eval gate passed on 8 rows" in done.stdout and "cosine_mean" in done.stdout
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["started"] == ["transformers", "vllm"]  # the reference, then the candidate, kept for the corpus
    assert result["open_at_start"] == [0, 0]  # the reference closed before the candidate started
    assert result["engine_processes_seen"] >= 1  # vLLM did start its engine process
    # vLLM's engine maps its workers' ring buffer; killed at close, it cannot unlink it: close() does
    assert result["segments_seen"], "no shared-memory segment read from the engine's processes"
    assert result == {**result, "engines": 0, "engine_processes_alive": [], "client_threads": [],
                      "segments_left": []}


def test_the_gate_never_holds_reference_and_candidate_engines_at_once(tmp_path, corpus, monkeypatch):
    """On one GPU the second model may not fit: the reference's engine is closed before the candidate's starts."""
    import tokenmill.engines as engines
    from tokenmill.gate import evaluate
    from tokenmill.models import resolve_model
    from tokenmill.spec import JobSpec

    held_at_start = []
    real_start = engines.start_engine

    def start_and_count(model_path, job):
        held_at_start.append(len(open_engines()))
        return real_start(model_path, job)

    monkeypatch.setattr(engines, "start_engine", start_and_count)
    spec = JobSpec.model_validate({
        "input": str(corpus), "output": str(tmp_path / "o"),
        "model": {"name": "all-MiniLM-L6-v2", "engine": "transformers", "dtype": "bfloat16"},
        "gate": {"reference": {"name": "all-MiniLM-L6-v2", "engine": "transformers"}, "sample_rows": 8},
    })
    from tokenmill.gate import candidate_model, job_for

    for side in (spec.gate.reference, candidate_model(spec)):  # none left open by earlier tests of the session
        engines.discard_engine(resolve_model(side.name), job_for(spec, side))
    before = len(open_engines())
    report = evaluate(spec, TEXTS, "test")
    assert held_at_start == [before, before]  # the candidate started with the reference already gone
    assert len(open_engines()) == before + 1  # the candidate stays: it runs the corpus if it passed
    assert report.metrics
    engines.discard_engine(resolve_model(spec.model_name), spec)


LEFTOVERS_SCRIPT = """
import multiprocessing, os, signal, time
from multiprocessing import shared_memory

from tokenmill.vllm_engine import EngineLeftovers


def worker(pipe):  # as a vLLM worker: a segment of its own
    segment = shared_memory.SharedMemory(create=True, size=4096)
    pipe.send(segment.name)
    time.sleep(600)


def core(pipe, shared_name):  # as vLLM's engine core: a segment of its own, a worker, and one it was given
    segment = shared_memory.SharedMemory(create=True, size=4096)
    given = shared_memory.SharedMemory(name=shared_name)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    context.Process(target=worker, args=(send,), daemon=True).start()
    pipe.send(segment.name)
    pipe.send(receive.recv())
    time.sleep(600)


if __name__ == "__main__":
    ours = shared_memory.SharedMemory(create=True, size=4096)
    context = multiprocessing.get_context("spawn")  # as vLLM starts its engine core
    receive, send = context.Pipe(duplex=False)
    engine = context.Process(target=core, args=(send, ours.name))
    engine.start()
    leftovers = EngineLeftovers([engine], {})
    try:
        made = {receive.recv(), receive.recv()}
        leftovers.look_again()
        assert leftovers.segments == made, (leftovers.segments, made)  # not ours, which the core maps too
        assert len(leftovers.pids) == 2, leftovers.pids
    finally:
        for pid in leftovers.pids or [engine.pid]:  # vLLM's kill of its process tree: SIGKILL, and no wait
            os.kill(pid, signal.SIGKILL)
    leftovers.unlink()
    left = sorted(name for name in made if os.path.exists("/dev/shm/" + name))
    kept = os.path.exists("/dev/shm/" + ours.name)
    ours.close()
    ours.unlink()
    print("RESULT", left, kept, flush=True)
"""


def test_close_unlinks_what_killed_engine_processes_left_and_spares_its_own(tmp_path):
    """What VLLMEngine.close() does after vLLM kills its engine's process tree, on real killed processes
    (a core and its worker, each with a segment): their segments are unlinked without a word from the
    resource tracker at exit; one this process made and shared with the core stays."""
    if not os.path.isdir("/dev/shm") or not os.path.exists(f"/proc/{os.getpid()}/maps"):
        pytest.skip("needs Linux /proc and /dev/shm")
    (tmp_path / "leftovers.py").write_text(LEFTOVERS_SCRIPT)
    done = subprocess.run([sys.executable, "leftovers.py"], cwd=tmp_path, env=environment(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT [] True" in done.stdout, done.stdout + done.stderr
    # the tracker, at exit: "leaked shared_memory objects", or a traceback for a name it did not hold
    assert "resource_tracker" not in done.stderr and "Traceback" not in done.stderr, done.stderr
