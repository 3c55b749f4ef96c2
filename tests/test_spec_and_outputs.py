import json

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from tokenmill.cli import build_parser, spec_from_args
from tokenmill.manifest import build_manifest
from tokenmill.outputs import OutputStore, rejects_table
from tokenmill.results import ShardResult
from tokenmill.spec import JobSpec


def test_every_field_has_a_default_and_the_default_is_the_demo():
    spec = JobSpec()
    assert spec.mode == "embed" and spec.model_name == "all-MiniLM-L6-v2"
    assert JobSpec(mode="generate").model_name == "SmolLM2-135M-Instruct"
    assert spec.tracking.mlflow_tracking_uri is None  # then $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db


def test_yaml_loads_and_flags_override_the_file(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(
        "input: s3://bucket/docs/\nmode: generate\ngeneration:\n  max_tokens: 64\n"
        "model:\n  name: SmolLM2-135M-Instruct\n  engine_kwargs: {max_model_len: 2048}\n"
    )
    args = build_parser().parse_args(
        ["run", "--config", str(config), "--max-tokens", "32", "--set", "batching.token_budget=4096",
         "--output", "out/x"])
    spec = spec_from_args(args)
    assert spec.input == "s3://bucket/docs/" and spec.output == "out/x"
    assert spec.generation.max_tokens == 32 and spec.batching.token_budget == 4096
    assert spec.model.engine_kwargs == {"max_model_len": 2048}
    assert type(spec).model_validate_json(spec.model_dump_json()) == spec


def test_a_typo_in_the_job_file_is_an_error(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("inptu: data/\n")
    with pytest.raises(ValidationError, match="inptu"):
        JobSpec.from_yaml(config)


def test_outputs_are_written_whole_with_no_temporary_files_left(tmp_path):
    store = OutputStore(str(tmp_path / "out"))
    table = rejects_table("s1", "f.parquet", [(3, "x", "text is null")], by_byte_offset=False)
    store.write_table(store.shard_rejects("s1"), table)
    store.write_json(store.shard_record("s1"), {"a": 1})
    assert pq.read_table(store.shard_rejects("s1")).to_pylist() == [
        {"shard_id": "s1", "file": "f.parquet", "row": 3, "byte_offset": None, "id": "x", "reason": "text is null"}]
    assert json.loads((tmp_path / "out" / "_shards" / "s1.json").read_text()) == {"a": 1}
    leftovers = [p for p in (tmp_path / "out").rglob("*") if ".tmp-" in p.name]
    assert leftovers == []


def _result(shard_id, rows_in, rows_out, rejected, tokens):
    return ShardResult(shard_id=shard_id, fingerprint="f" + shard_id, uri="u", output="o", rows_in=rows_in,
                       rows_out=rows_out, rows_rejected=rejected, rows_truncated=0, input_tokens=tokens,
                       output_tokens=0, batches=1, real_tokens=tokens, padded_slots=tokens,
                       baseline_padded_slots=tokens, engine_seconds=1.0, seconds=2.0)


def test_manifest_lists_shards_and_balances_rows():
    manifest = build_manifest(JobSpec(), [_result("b", 10, 8, 2, 100), _result("a", 5, 5, 0, 50)], shards_total=3)
    assert [s["shard_id"] for s in manifest["shards"]] == ["a", "b"]
    assert manifest["totals"]["rows_in"] == 15
    assert manifest["totals"]["rows_in"] == manifest["totals"]["rows_out"] + manifest["totals"]["rows_rejected"]
    assert manifest["complete"] is False and manifest["shards_done"] == 2
