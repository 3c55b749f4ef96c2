"""The batch flow's form, as the Prefect UI gets it: the flow's parameter schema (what `prefect
deploy` stores), validated the way the Prefect server validates a run's parameters."""

from __future__ import annotations

import re
import sys

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError as SchemaError
from prefect.utilities.schema_tools.validation import validate
from pydantic import ValidationError

from tokenmill.spec import (
    DEFAULT_INPUT,
    DTYPES,
    QUANTIZATIONS,
    GenerationParams,
    JobSpec,
    ModelSpec,
    _vllm_quantizations,
)


def _batch_flow():
    try:
        from tokenmill.flows.batch import batch_flow
    except ImportError:
        from tokenmill.flows.batch import batch_flow
    return batch_flow


@pytest.fixture(scope="module")
def schema() -> dict:
    # exactly what RunnerDeployment.apply sends as parameter_openapi_schema
    return parameter_schema(_batch_flow()).model_dump(exclude_unset=True)


def _label(schema: dict, prop: dict) -> str | None:
    """The form's label for a property: its own title. Prefect's form does not read a $ref's definition
    for it; without a title it shows the field's name, title-cased ("Openai Batch")."""
    return prop.get("title")


def test_every_section_has_a_title_and_every_field_a_description(schema):
    definitions = schema["definitions"]
    assert {"PrefectJob", "ModelSpec", "GenerationParams", "ChatMessage", "BatchingSpec", "PricingSpec",
            "TrackingSpec", "GateSpec", "FleetSpec"} <= set(definitions)
    for name, definition in definitions.items():
        assert definition.get("title") and definition["title"] != name, f"{name} shows its class name"
        assert definition.get("description"), name
        for key, prop in definition["properties"].items():
            assert len(prop.get("description", "")) >= 15, f"{name}.{key} has no description"
            assert _label(schema, prop), f"{name}.{key} has no label"
    titles = [d["title"] for d in definitions.values()]
    assert len(set(titles)) == len(titles), titles
    assert definitions["GateSpec"]["properties"]["reference"]["title"] == "Reference model"


def _properties(schema: dict):
    for name, definition in schema["definitions"].items():
        for key, prop in definition["properties"].items():
            yield f"{name}.{key}", prop


def test_labels_spell_acronyms_and_descriptions_survive_the_markdown(schema):
    # The form renders descriptions as markdown with HTML: a bare <output> vanishes from the text.
    for where, prop in _properties(schema):
        words = set(re.findall(r"[A-Za-z]+", prop["title"]))
        assert not words & {"Usd", "Gpu", "Cpu", "Mlflow", "Uri", "Id", "Ids", "Json", "Hnsw", "Openai", "Ivf", "Pq"}, \
            f"{where}: {prop['title']!r}"
        assert not re.search(r"<[a-z]", re.sub(r"`[^`]*`", "", prop["description"])), f"{where}: {prop['description']}"
    # choices are named for what they mean, not for their JSON types ("list", "str")
    job = schema["definitions"]["PrefectJob"]["properties"]
    assert [o["title"] for o in job["passthrough_columns"]["anyOf"]] == ["Columns", "All columns"]
    assert job["passthrough_columns"]["anyOf"][1]["enum"] == ["all"]  # a const shows as an empty, locked box
    name = schema["definitions"]["ModelSpec"]["properties"]["name"]
    assert [o["title"] for o in name["anyOf"]] == ["Path or Hugging Face name", "Built-in model"]
    assert {"all-MiniLM-L6-v2", "SmolLM2-135M-Instruct"} <= set(name["anyOf"][1]["enum"])
    messages = schema["definitions"]["GenerationParams"]["properties"]["messages"]
    assert messages["default"] == [m.model_dump() for m in GenerationParams().messages]  # the form shows the prompt


def test_dtype_and_quantization_offer_the_known_values(schema):
    model = schema["definitions"]["ModelSpec"]["properties"]
    assert model["dtype"]["enum"] == list(DTYPES) and model["dtype"]["default"] == "auto"
    common, other, none = model["quantization"]["anyOf"]
    assert common["enum"] == list(QUANTIZATIONS) and {"fp8", "awq", "gptq", "compressed-tensors"} <= set(common["enum"])
    assert other == {"type": "string", "title": "Other vLLM method"} and none["type"] == "null"


def _parameters(spec: dict) -> dict:
    return {"spec": spec}


def test_the_api_takes_what_the_spec_takes_and_asks_for_input_and_output(schema):
    job = {"input": "s3://corpus/in/", "output": "s3://corpus/out/"}
    validate(_parameters(job), schema, raise_on_error=True)
    # a full job, as the orchestrator sends it to its workers, including a quantization the form
    # does not list: the schema must not refuse what vLLM (and the spec) accept
    full = JobSpec(**job, model={"quantization": "fp8"},
                   gate={"reference": {"name": "m"}, "candidate": {"dtype": "bf16"}}).model_dump(mode="json")
    full["model"]["quantization"] = "some_newer_vllm_method"
    validate(_parameters(full), schema, raise_on_error=True)
    for missing in ("input", "output"):
        with pytest.raises(SchemaError, match=f"'{missing}' is a required property"):
            validate(_parameters({k: v for k, v in job.items() if k != missing}), schema, raise_on_error=True)
    with pytest.raises(SchemaError, match="should be non-empty|too short"):
        validate(_parameters({**job, "input": ""}), schema, raise_on_error=True)
    with pytest.raises(SchemaError, match="fp4"):
        validate(_parameters({**job, "model": {"dtype": "fp4"}}), schema, raise_on_error=True)


def test_the_form_does_not_prefill_the_demo_corpus_but_python_keeps_it(schema):
    job = schema["definitions"]["PrefectJob"]
    assert {"input", "output"} <= set(job["required"])
    assert "default" not in job["properties"]["input"] and "default" not in job["properties"]["output"]
    assert JobSpec().input == DEFAULT_INPUT  # the CLI's demo job


def test_dtype_aliases_read_as_their_full_names():
    assert [ModelSpec(dtype=d).dtype for d in ("half", "FP16", "bf16", "float", "fp32", "bfloat16")] == \
        ["float16", "float16", "bfloat16", "float32", "float32", "bfloat16"]


def test_a_bad_dtype_is_refused_naming_the_known_ones():
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate({"model": {"dtype": "fp8"}})
    message = str(refused.value)
    assert "model.dtype" in message and "'fp8'" in message
    assert all(name in message for name in DTYPES)


def test_quantization_takes_the_installed_vllms_methods_and_refuses_typos():
    assert ModelSpec(quantization="FP8").quantization == "fp8"
    assert ModelSpec(quantization="").quantization is None
    only_vllm = sorted(_vllm_quantizations() - set(QUANTIZATIONS))
    assert only_vllm, "the installed vLLM lists no method beyond the form's"
    assert ModelSpec(quantization=only_vllm[0]).quantization == only_vllm[0]
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate({"model": {"quantization": "fp9"}})
    message = str(refused.value)
    assert "model.quantization" in message and "'fp9'" in message
    assert all(name in message for name in QUANTIZATIONS)


def test_the_quantization_list_read_from_vllms_source_is_the_one_vllm_imports():
    if "vllm.model_executor.layers.quantization" in sys.modules:
        pytest.skip("vLLM already imported: the source is not read")
    from_source = _vllm_quantizations()
    assert "vllm" not in sys.modules  # read without the import (torch, seconds)
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert from_source == set(QUANTIZATION_METHODS)
    assert _vllm_quantizations() == set(QUANTIZATION_METHODS)
