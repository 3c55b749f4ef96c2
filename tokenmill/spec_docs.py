"""The job file's reference (docs/job-spec.md), written from the job spec's models: every field, section
by section, with its type, default and description. `tokenmill spec-docs` writes it; tests/test_docs.py
fails when the committed file and the models differ.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel

from tokenmill.spec_fields import SpecField

NAMES = {str: "string", int: "integer", float: "number", bool: "true or false", Any: "any"}
BOUNDS = {annotated_types.Ge: "≥", annotated_types.Gt: ">", annotated_types.Le: "≤", annotated_types.Lt: "<"}
HEADER = """# The job file

Every field a job takes, in YAML (`tokenmill run --config job.yaml`), as flags (`tokenmill run --help`)
or as `--set FIELD=VALUE` (a dotted field, a YAML value). A nested section is a mapping under its name;
an empty field (`null`) takes the behaviour its description names.

Generated from the job spec's models by `tokenmill spec-docs --out docs/job-spec.md`: edit the models'
descriptions, not this file (`tests/test_docs.py` fails when the two differ).
"""


def job_spec_markdown(model: type[BaseModel]) -> str:
    """The reference of a job model and of every section it holds, each section once."""
    sections = spec_sections(model)
    anchors = {section: _anchor(path) for path, section in sections}
    lines = [HEADER]
    lines += [f"- [{_heading(path, section)}](#{anchors[section]})" for path, section in sections]
    for path, section in sections:
        lines += ["", f'<a id="{anchors[section]}"></a>', "", f"## {_heading(path, section)}", ""]
        if section.__doc__ and path:
            lines += [" ".join(section.__doc__.split()), ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for name, info in section.model_fields.items():
            field = SpecField(f"{path}.{name}" if path else name, info)
            cells = [f"`{name}`", _kind(info, anchors), _default(field), field.description]
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def spec_sections(model: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """(dotted path, model) for the job and every model its fields hold, each once, nearest first."""
    found: list[tuple[str, type[BaseModel]]] = [("", model)]
    seen = {model}
    for path, current in found:  # grows as it goes: breadth first
        for name, info in current.model_fields.items():
            for nested in _models_in(info.annotation):
                if nested not in seen:
                    seen.add(nested)
                    found.append((f"{path}.{name}" if path else name, nested))
    return found


def type_text(annotation: Any, anchors: dict[type, str]) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        text = " or ".join(type_text(arg, anchors) for arg in args if arg is not type(None))
        return f"{text}, or empty" if type(None) in args else text
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if origin is list:
        return f"list of {type_text(args[0], anchors)}"
    if origin is dict:
        return f"mapping ({type_text(args[0], anchors)} → {type_text(args[1], anchors)})"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.model_config.get('title') or annotation.__name__}](#{anchors[annotation]})"
    return NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def _kind(info, anchors: dict[type, str]) -> str:
    """The type and its bounds, which hold for a value (not for empty)."""
    text = type_text(info.annotation, anchors)
    empty = text.endswith(", or empty")
    return text.removesuffix(", or empty") + _bounds(info) + (", or empty" if empty else "")


def _bounds(info) -> str:
    found = [f"{sign} {getattr(rule, next(iter(rule.__dataclass_fields__)))}"
             for rule in info.metadata for kind, sign in BOUNDS.items() if isinstance(rule, kind)]
    return f" ({', '.join(found)})" if found else ""


def _default(field: SpecField) -> str:
    if field.info.is_required():
        return "required"
    value = field.default()
    if isinstance(value, BaseModel):
        return "its fields' defaults"
    if value is None:
        return "empty"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [item.model_dump() for item in value]
    return f"`{value}`" if isinstance(value, str) and value else f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    """Table-safe: a pipe would end the cell, a newline the row, and <output> would read as an HTML tag."""
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


def _anchor(path: str) -> str:
    return path.replace(".", "-").replace("_", "-") or "job"


def _heading(path: str, section: type[BaseModel]) -> str:
    title = section.model_config.get("title") or section.__name__
    return f"`{path}`: {title}" if path else title
