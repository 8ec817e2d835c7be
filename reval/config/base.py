"""The ground every config section stands on: ``_Section``, the rules every section keeps
(unknown keys are errors, finite floats, no bool for a number), and ``ConfigError``."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A config that cannot be used; the message names the offending field."""


def _takes_bool(annotation: Any) -> bool:
    """Whether a field's type admits a bool (``bool``, ``bool | None``, a Literal of bools)."""
    if annotation is bool:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_takes_bool(a) for a in get_args(annotation))
    return False


class _Section(BaseModel):
    """Every section: unknown keys are errors, floats are finite (no NaN or Infinity, which a
    JSON or TOML override can spell), and a bool is not a number (lax validation would take
    ``rounds = true`` as 1)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if isinstance(value, bool) and name and not _takes_bool(cls.model_fields[name].annotation):
            raise ValueError(f"a boolean ({value}) where a number or text is expected")
        return value
