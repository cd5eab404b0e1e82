"""The base of every params model: :class:`Strict` (unknown keys refused, numbers never read as booleans) and
:class:`ConfigError`. Part of every run's code hash (``fedsilo.codehash``): how a value is read decides what trains."""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    model_validator,
)
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A params.yaml problem; the message names the key."""


def _bool_for_number(annotation: Any, value: Any) -> bool:
    """True when ``value`` puts a boolean where ``annotation`` wants an int or a float, at any depth of tuples,
    lists, dicts and optionals (pydantic's lax mode would read YAML's ``true`` as 1)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _bool_for_number(args[0], value)
    if origin in (Union, types.UnionType):
        if isinstance(value, bool) and bool in args:
            return False
        return any(_bool_for_number(a, value) for a in args if a is not type(None))
    if isinstance(value, bool):
        return annotation in (int, float)
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return bool(args) and any(_bool_for_number(args[0], v) for v in value)
        return any(_bool_for_number(a, v) for a, v in zip(args, value))
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return any(_bool_for_number(args[1], v) for v in value.values())
    return False


class Strict(BaseModel):
    """The base of every params model (the method params too): unknown keys are refused, and a number must be a
    finite number: ``.inf`` / ``.nan`` and booleans (``true``, ``yes``, ``on``) are refused where an int or a float
    is expected, instead of training to NaN or becoming 1."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_number(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, v in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if field is not None and _bool_for_number(field.annotation, v):
                    raise PydanticCustomError(
                        "bool_for_number", "expected a number, got a boolean (YAML reads true/false/yes/no/on/off as booleans)",
                        {"field": name},
                    )
        return data
