"""Job-spec sections built from the engine's own dataclasses, so each setting is declared once.

``EngineConfig`` and ``SamplingParams`` mark their user settings with ``jobrunner.engine.settings.setting``
(description, bounds). :func:`section_fields` turns those fields into pydantic field definitions: the YAML key
is the field name, the type is the field's type (tuples become lists, as YAML writes them), the bounds become
pydantic's ``ge`` / ``gt`` / ``le`` (so an error reads "sampling.n: Input should be greater than or equal to 1"),
the default is the field's own unless the spec picks another for jobs.
"""

from __future__ import annotations

from dataclasses import MISSING
from typing import Any, Union, get_args, get_origin

from pydantic import Field

from jobrunner.engine.settings import SettingField, settings_of


def section_fields(cls: type, job_defaults: dict[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """``name -> (annotation, FieldInfo)`` for every user setting of dataclass ``cls`` (for ``create_model``).

    ``job_defaults``: defaults the job spec chooses instead of the dataclass's (e.g. greedy sampling).
    """
    job_defaults = job_defaults or {}
    unknown = sorted(set(job_defaults) - {s.name for s in settings_of(cls)})
    if unknown:
        raise ValueError(f"job defaults for {cls.__name__} name no setting: {', '.join(unknown)}")
    return {s.name: (_yaml_type(s.annotation), _field(s, job_defaults)) for s in settings_of(cls)}


def _field(item: SettingField, job_defaults: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {"description": item.setting.description, **item.setting.bounds()}
    if item.name in job_defaults:
        return Field(default=job_defaults[item.name], **kwargs)
    if item.field.default_factory is not MISSING:
        return Field(default_factory=item.field.default_factory, **kwargs)
    if item.field.default == ():
        return Field(default_factory=list, **kwargs)  # a tuple default is an empty YAML list
    if item.field.default is MISSING:
        return Field(**kwargs)
    return Field(default=item.field.default, **kwargs)


def _yaml_type(annotation: Any) -> Any:
    """``tuple[X, ...]`` -> ``list[X]`` (also inside ``| None``); every other type as it is."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[args[0]]
    if args and origin not in (tuple, list, dict) and type(None) in args:  # X | None
        return Union[tuple(_yaml_type(a) for a in args)]  # noqa: UP007 - built from a runtime tuple
    return annotation
