"""The job spec's fields, read from its pydantic models: what the CLI makes flags of and what the job
file reference (docs/job-spec.md) lists, so neither keeps a list of its own.

A field is reached by its dotted path (`batching.token_budget`); a section is a field whose value is a
model of its own (`batching`), always there when its default is one, optional when it may be empty
(`gate`, `index`).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

SCALARS = (str, int, float, bool)


@dataclass(frozen=True)
class SpecField:
    path: str  # dotted, from the job's top: "batching.token_budget"
    info: FieldInfo

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def section(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def description(self) -> str:
        return self.info.description or ""

    def options(self) -> list[Any]:
        """The annotation's alternatives, empty (None) left out: `int | None` -> [int]."""
        return [option for option in _options(self.info.annotation) if option is not type(None)]

    def scalar(self) -> tuple[type, tuple[Any, ...]] | None:
        """(type, choices) for a field that takes one plain value (a string, number, flag or one of a
        Literal's values); None for lists, mappings and sections."""
        options = self.options()
        if options and all(typing.get_origin(o) is Literal for o in options):
            choices = tuple(value for o in options for value in typing.get_args(o))
            return type(choices[0]), choices
        if len(options) == 1 and options[0] in SCALARS:
            return options[0], ()
        return None

    def section_model(self) -> type[BaseModel] | None:
        """The model of a section field (given or optional); None for any other field."""
        models = [o for o in self.options() if isinstance(o, type) and issubclass(o, BaseModel)]
        return models[0] if len(models) == 1 and len(self.options()) == 1 else None

    def always_there(self) -> bool:
        """A section that is never empty: its default is the section's model."""
        return self.section_model() is not None and not self.info.is_required() and self.default() is not None

    def default(self) -> Any:
        if self.info.default_factory is not None:
            return self.info.default_factory()
        return None if self.info.default is PydanticUndefined else self.info.default


def _options(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [option for arg in typing.get_args(annotation) for option in _options(arg)]
    return [annotation]


def spec_fields(model: type[BaseModel], prefix: str = "") -> Iterator[SpecField]:
    """Every field of the model and, depth first, of its sections that are always there."""
    for name, info in model.model_fields.items():
        field = SpecField(f"{prefix}{name}", info)
        yield field
        if field.always_there():
            yield from spec_fields(field.section_model(), f"{field.path}.")
