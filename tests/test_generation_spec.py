"""Generation jobs without an engine: template columns, their checks before any engine starts,
the sampling-params builder, response formats checked and compared, engine support at validation."""

import json

import pyarrow as pa
import pytest
from pydantic import BaseModel, ValidationError

from conftest import TEST_GENERATE_MODEL, write_parquet
from tokenmill.engine_protocol import Generation
from tokenmill.engines import open_engines
from tokenmill.errors import ConfigError, InputError
from tokenmill.generation import OutputChecker, check_response_format, parsed_agreement, sampling_kwargs
from tokenmill.outputs import build_output, structured_invalid_rows
from tokenmill.prompts import check_job_inputs, prefix_order, read_columns, template_columns, validate_job_rows
from tokenmill.shards import ROW_NUMBER, discover_shards
from tokenmill.spec import GenerationParams, JobSpec

FEW_SHOT = [
    {"role": "system", "content": "You label support tickets about {product}."},
    {"role": "user", "content": "Ticket: it broke"},
    {"role": "assistant", "content": '{"label": "negative"}'},
    {"role": "user", "content": "Product: {product}\nTicket: {text}"},
]


class Label(BaseModel):
    label: str
    confidence: float


def generate_spec(**generation) -> JobSpec:
    return JobSpec(mode="generate", model=TEST_GENERATE_MODEL, generation=generation)


def test_placeholders_name_columns_and_json_braces_are_left_alone():
    spec = generate_spec(messages=FEW_SHOT)
    assert template_columns(spec) == ["product", "text"]
    assert read_columns(spec) == ["id", "text", "product"]
    body = spec.model_copy(update={"text_column": "body", "passthrough_columns": ["lang"]})
    assert read_columns(body) == ["id", "body", "product", "lang"]
    assert read_columns(spec.model_copy(update={"passthrough_columns": "all"})) is None


@pytest.fixture
def engine_starts(monkeypatch):
    """Every engine start in the test, noted (the session may hold engines other modules opened)."""
    import tokenmill.engines as engines

    started, real_start = [], engines.start_engine

    def start_and_note(model_path, job):
        started.append(model_path)
        return real_start(model_path, job)

    monkeypatch.setattr(engines, "start_engine", start_and_note)
    held = {id(engine) for engine in open_engines()}
    yield started
    assert {id(engine) for engine in open_engines()} == held  # none opened, none reused and left


def test_a_misspelled_column_is_named_before_any_engine_starts(tmp_path, engine_starts):
    write_parquet(tmp_path / "in.parquet", [1, 2], ["a", "b"], product=["x", "y"])
    spec = generate_spec(messages=[{"role": "user", "content": "{prodcut}: {text}"}]).model_copy(
        update={"input": str(tmp_path)})
    with pytest.raises(InputError) as error:
        check_job_inputs(spec, discover_shards(spec.input))
    assert error.value.column == "prodcut" and "did you mean 'product'" in str(error.value)
    missing = generate_spec().model_copy(update={"input": str(tmp_path), "passthrough_columns": ["lang"]})
    with pytest.raises(InputError, match="names it in passthrough_columns"):
        check_job_inputs(missing, discover_shards(missing.input))
    assert engine_starts == []


def test_the_batch_flow_fails_on_a_misspelled_column_without_starting_an_engine(tmp_path, engine_starts):
    from tokenmill.flows.batch import batch_flow
    from tokenmill.tasks.job import PrefectJob

    write_parquet(tmp_path / "in.parquet", [1, 2], ["a", "b"], product=["x", "y"])
    spec = PrefectJob.model_validate({
        "input": str(tmp_path / "in.parquet"), "output": str(tmp_path / "out"), "mode": "generate",
        "model": TEST_GENERATE_MODEL.model_dump(), "generation": {"messages": [{"content": "{prodcut}: {text}"}]},
        "tracking": {"mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "tests"}})
    with pytest.raises(InputError, match="prodcut"):
        batch_flow(spec)
    assert engine_starts == []


def test_rows_missing_a_template_value_or_a_chat_are_rejected_with_the_reason():
    table = pa.table({"id": [1, 2, 3], "text": ["a", "b", "c"], "product": ["x", None, "z"], ROW_NUMBER: [0, 1, 2]})
    validated = validate_job_rows(table, "mem", generate_spec(messages=FEW_SHOT))
    assert validated.rejects == [(1, 2, "product is null (the prompt's {product})")]
    assert validated.valid.column("id").to_pylist() == [1, 3]
    chats = pa.table({"id": [1, 2], "chat": [json.dumps([{"role": "user", "content": "hi"}]), "[1]"],
                      ROW_NUMBER: [0, 1]})
    spec = generate_spec(messages_column="chat")
    validated = validate_job_rows(chats, "mem", spec)
    assert validated.rejects[0][:2] == (1, 2) and "not {role: string, content: string}" in validated.rejects[0][2]


def test_sampling_kwargs_take_every_field_and_per_row_overrides():
    params = GenerationParams(n=2, temperature=0.8, stop=["\n"], top_k=5, min_p=0.1, presence_penalty=0.5,
                              frequency_penalty=0.2, repetition_penalty=1.1, min_tokens=2, logprobs=3, seed=7,
                              response_format={"choice": ["yes", "no"]})
    kwargs = sampling_kwargs(params)
    assert kwargs["n"] == 2 and kwargs["stop"] == ["\n"] and kwargs["top_k"] == 5 and kwargs["logprobs"] == 3
    assert kwargs["structured_outputs"] == {"choice": ["yes", "no"]}
    row = sampling_kwargs(params, {"max_tokens": 5, "temperature": 0.7, "response_format": {"regex": "[0-9]+"}})
    assert row["max_tokens"] == 5 and row["temperature"] == 0.7 and row["structured_outputs"] == {"regex": "[0-9]+"}
    assert "structured_outputs" not in sampling_kwargs(params, {"response_format": None})
    from tokenmill.generation import vllm_sampling_params  # the vLLM object itself, no engine

    sampling = vllm_sampling_params(params, {"max_tokens": 5})
    assert sampling.max_tokens == 5 and sampling.structured_outputs.choice == ["yes", "no"]


def test_a_response_format_from_a_file_or_a_pydantic_model(tmp_path):
    schema = Label.model_json_schema()
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    for response_format in ({"json_schema": str(tmp_path / "schema.json")},
                            {"pydantic_model": f"{__name__}:Label"}, {"json_schema": schema}):
        params = GenerationParams(response_format=response_format)
        assert sampling_kwargs(params)["structured_outputs"] == {"json": schema}
    with pytest.raises(ConfigError, match="cannot import"):
        check_response_format(GenerationParams(response_format={"pydantic_model": "nowhere:Label"}))
    with pytest.raises(ConfigError, match="regex does not compile"):
        check_response_format(GenerationParams(response_format={"regex": "(["}))
    with pytest.raises(ValidationError, match="exactly one"):
        GenerationParams(response_format={"choice": ["a"], "regex": "a"})


def test_outputs_that_do_not_conform_are_marked_with_the_reason():
    checker = OutputChecker(GenerationParams(response_format={"pydantic_model": f"{__name__}:Label"}).response_format)
    assert checker.check('{"confidence": 0.5, "label": "ok"}').error is None
    assert checker.check('{"label": "ok", "confidence": 0.5}').parsed == '{"confidence": 0.5, "label": "ok"}'
    assert "hit max_tokens" in checker.check('{"label": "o', "length").error
    assert "confidence" in checker.check('{"label": "ok"}').error
    spec = generate_spec(response_format={"pydantic_model": f"{__name__}:Label"}, n=2, temperature=0.5)
    results = [Generation("", 6, "stop", samples=(Generation('{"label": "a", "confidence": 1}', 3, "stop"),
                                                   Generation('{"label": "a"', 3, "length")))]
    valid = pa.table({"id": [1], "text": ["t"]})
    output = build_output(valid, spec, results, [4], [False])
    assert output.column_names[:4] == ["id", "output_text", "parsed", "structured_error"]
    assert output.column("output_text").to_pylist() == [['{"label": "a", "confidence": 1}', '{"label": "a"']]
    assert output.column("output_tokens").to_pylist() == [6]
    assert structured_invalid_rows(output) == 1


def test_parsed_agreement_is_field_by_field():
    reference = ['{"confidence": 0.9, "label": "a"}', '{"confidence": 0.5, "label": "b"}', '"x"', None]
    candidate = ['{"confidence": 0.9, "label": "a"}', '{"confidence": 0.7, "label": "b"}', '"x"', '"x"']
    assert parsed_agreement(reference, candidate) == pytest.approx((1 + 0.5 + 1 + 0) / 4)


def test_the_transformers_engine_refuses_what_generate_cannot_do_at_validation():
    model = {**TEST_GENERATE_MODEL.model_dump(), "engine": "transformers"}
    with pytest.raises(ValidationError, match="generation.logprobs, generation.response_format"):
        JobSpec(mode="generate", model=model, generation={"logprobs": 2, "response_format": {"choice": ["a"]}})
    with pytest.raises(ValidationError, match="n=2 needs temperature > 0"):
        JobSpec(mode="generate", model=model, generation={"n": 2})
    JobSpec(mode="generate", model=model, generation={"n": 2, "temperature": 0.7, "top_k": 5, "min_p": 0.1,
                                                      "stop": ["."], "repetition_penalty": 1.2, "min_tokens": 1})


def test_prefix_order_puts_shared_prefixes_together_and_keeps_ties_in_order():
    rows = [[1, 2, 9], [5, 6, 7], [1, 2, 3], [5, 6, 1], [1, 2, 9]]
    assert prefix_order(rows) == [2, 0, 4, 3, 1]
