"""User settings declared once, on the engine's own dataclasses (``EngineConfig``, ``SamplingParams``).

A field made with :func:`setting` is a user setting: besides its type and default it carries a description and
its numeric bounds. The job spec builds its ``engine:`` and ``sampling:`` sections from these fields
(:mod:`jobrunner.spec_sections`), so a new setting is one field here: its YAML key is the field's name, its
default the field's default (the spec may choose another for jobs), its error messages name the field. A plain
dataclass field is internal: set by code, never by a job spec. Standard library only (no pydantic here).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import MISSING, dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

SETTING = "jobrunner.setting"  # the key of a field's metadata that makes it a user setting


@dataclass(frozen=True)
class Setting:
    """What the job spec shows and checks for one field besides its type: its description and bounds."""

    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def bounds(self) -> dict[str, float]:
        """The bounds that are set, as keyword arguments (``ge`` / ``gt`` / ``le``, pydantic's names)."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None}


def setting(default: Any = MISSING, *, description: str, default_factory: Any = MISSING, ge: float | None = None,
            gt: float | None = None, le: float | None = None, **field_kwargs: Any) -> Any:
    """A dataclass field that is also a job-spec setting (see the module docstring)."""
    metadata = {SETTING: Setting(description, ge, gt, le)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata, **field_kwargs)


@dataclass(frozen=True)
class SettingField:
    """One user setting of a dataclass: its field (name, default), :class:`Setting` and resolved type."""

    field: dataclasses.Field
    setting: Setting
    annotation: Any

    @property
    def name(self) -> str:
        return self.field.name


@functools.cache
def settings_of(cls: type) -> tuple[SettingField, ...]:
    """The user settings of dataclass ``cls``, in declaration order."""
    hints = get_type_hints(cls)
    return tuple(SettingField(f, f.metadata[SETTING], hints[f.name]) for f in dataclasses.fields(cls)
                 if SETTING in f.metadata)


def setting_of(cls: type, name: str) -> SettingField:
    """The user setting ``name`` of dataclass ``cls`` (KeyError naming it when there is none)."""
    for item in settings_of(cls):
        if item.name == name:
            return item
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


def setting_default(cls: type, name: str) -> Any:
    """The default of setting ``name`` of ``cls``: what a job gets, and what a tool that builds ``cls`` should use
    instead of restating it."""
    f = setting_of(cls, name).field
    return f.default_factory() if f.default_factory is not MISSING else f.default


def literal_choices(annotation: Any) -> tuple[Any, ...]:
    """The allowed values of a ``Literal[...]`` annotation (``()`` for any other type)."""
    return get_args(annotation) if get_origin(annotation) is Literal else ()


def check_settings(obj: Any) -> None:
    """ValueError naming ``<Class>.<field>`` when a setting of ``obj`` is outside its bounds or choices."""
    owner = type(obj).__name__
    for item in settings_of(type(obj)):
        value = getattr(obj, item.name)
        choices = literal_choices(item.annotation)
        if choices and value not in choices:
            raise ValueError(f"{owner}.{item.name} must be {'|'.join(map(str, choices))}, got {value!r}")
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        for op, bound in item.setting.bounds().items():
            if not _OPS[op][1](value, bound):
                raise ValueError(f"{owner}.{item.name} must be {_OPS[op][0]} {bound:g}, got {value!r}")


_OPS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b), "le": ("<=", lambda v, b: v <= b)}
