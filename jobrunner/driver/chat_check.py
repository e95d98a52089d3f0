"""Chat rows for a model without a chat template, refused before any worker starts.

A base model (e.g. the alias ``gemma3-270m``) has no chat template: a row given as chat messages cannot become
its prompt, and a worker would load the model only to write every such row as an error row. `validate` and
`run` call :func:`chat_template_problem` on the spec (the settings that make every row a chat), `validate` also
:func:`is_chat_prompt` on each row it reads (an OpenAI batch file's /v1/chat/completions lines).
"""

from __future__ import annotations

from typing import Any

from jobrunner.spec import JobSpec


def chat_settings(spec: JobSpec) -> list[str]:
    """The spec's settings that make rows chats (each needs the model's chat template)."""
    inp = spec.input
    named = {"input.messages_column": inp.messages_column, "input.system_prompt": inp.system_prompt,
             "input.system_prompt_column": inp.system_prompt_column, "input.tools": inp.tools,
             "input.tools_column": inp.tools_column}
    return [name for name, value in named.items() if value]


def lacks_chat_template(spec: JobSpec) -> bool:
    """Whether the job's model is known (from files alone) to have no chat template and the spec gives none."""
    if spec.input.chat_template or spec.engine.factory:
        return False
    from jobrunner.models.chat_template import has_chat_template

    return has_chat_template(spec.model.source) is False


def chat_template_problem(spec: JobSpec) -> str | None:
    """One line refusing the job when its rows are chats and its model has no chat template; None when fine."""
    settings = chat_settings(spec)
    if not settings or not lacks_chat_template(spec):
        return None
    verb = "makes" if len(settings) == 1 else "make"
    return f"{' and '.join(settings)} {verb} every row a chat, but {no_template(spec)}"


def no_template(spec: JobSpec) -> str:
    """'model.source X is a base model without a chat template: ...' and the two ways out."""
    return (f"model.source {spec.model.source!r} is a base model without a chat template: give it raw text "
            "(input.prompt_column, no system prompt or tools), set input.chat_template, or use an "
            "instruction-tuned model")


def is_chat_prompt(prompt: Any) -> bool:
    """Whether a request's prompt is chat messages (a list of dicts) rather than text or token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
