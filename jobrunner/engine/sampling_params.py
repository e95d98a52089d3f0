"""Per-request sampling settings, validated at the API boundary."""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from jobrunner.engine.settings import Setting, setting, settings_of

MAX_N = 128            # samples per request
MAX_LOGPROBS = 20      # top alternatives per token (OpenAI's limit)
MAX_PENALTY = 2.0      # presence / frequency penalty range is [-2, 2] (OpenAI)
MAX_LOGIT_BIAS = 100.0
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]: above it a sample is close to uniform noise


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible for this request whatever it is
    batched with (the random stream depends only on the seed, the sample index and the output position).
    ``stop`` strings are matched on the decoded text (also across token boundaries) and removed from the
    output unless ``include_stop_str_in_output``.

    ``n`` samples share the prompt's KV blocks. ``logprobs = K`` returns the sampled token's log-probability
    and the top K alternatives for every output token (``True`` is read as 0); ``prompt_logprobs = K`` the
    same for prompt tokens. At most one of ``json_schema`` (a mapping or its JSON text), ``regex`` and
    ``choice`` constrains the output with a grammar. Knobs as in vLLM / OpenAI: ``min_p``, ``presence_penalty``,
    ``frequency_penalty`` (OpenAI semantics, on output tokens), ``repetition_penalty`` (CTRL/transformers
    semantics, on prompt + output tokens), ``min_tokens`` (EOS and stop tokens masked until reached),
    ``logit_bias`` (token id -> bias added to the logits; keys may be strings of ints).

    Fields made with ``setting(...)`` are the job spec's ``sampling:`` keys and per-row overrides
    (:mod:`jobrunner.engine.settings`): their types and bounds, declared once there, are what
    :func:`_check_settings` checks (the spec's pydantic fields are built from the same declaration).
    """

    max_tokens: int = setting(16, description="Maximum number of generated tokens per row.", ge=1)
    temperature: float = setting(1.0, description="Sampling temperature; 0 = greedy (0..2, as OpenAI).", ge=0.0,
                                 le=MAX_TEMPERATURE)
    top_p: float = setting(1.0, description="Nucleus sampling probability mass.", gt=0.0, le=1.0)
    top_k: int = setting(0, description="Top-k sampling; 0 = off.", ge=0)
    min_p: float = setting(0.0, description="Drop tokens below min_p x the top probability.", ge=0.0, le=1.0)
    seed: int | None = setting(None, description="Per-request seed for reproducible sampling.")
    n: int = setting(1, description="Samples per row (one output row each, sample_index).", ge=1, le=MAX_N)
    stop: tuple[str, ...] = setting((), description="Stop strings (removed from the output).")
    stop_token_ids: tuple[int, ...] = setting((), description="Token ids that stop generation.")
    include_stop_str_in_output: bool = setting(
        False, description="Keep the matched stop string at the end of the output.")
    ignore_eos: bool = setting(False, description="Keep generating past the end-of-sequence token.")
    min_tokens: int = setting(0, description="Generate at least this many tokens before EOS / stops.", ge=0)
    presence_penalty: float = setting(0.0, description="Subtract this from logits of tokens already generated.",
                                      ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = setting(0.0, description="Subtract this x count from logits of generated tokens.",
                                       ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = setting(
        1.0, description="Divide (multiply if negative) logits of prompt/output tokens; 1 = off.", gt=0.0)
    logit_bias: dict[int, float] = setting(description="Token id -> bias added to its logit every step.",
                                           default_factory=dict, hash=False)
    logprobs: int | None = setting(
        None, description="Per output token: the sampled token's logprob and the top K alternatives (0..20).",
        ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = setting(
        None, description="Per prompt token: its logprob and the top K alternatives.", ge=0, le=MAX_LOGPROBS)
    json_schema: dict[str, Any] | str | None = setting(
        None, description="Constrain the output to JSON valid against this schema (mapping or JSON text).",
        hash=False)
    regex: str | None = setting(None, description="Constrain the output to match this regular expression.")
    choice: tuple[str, ...] | None = setting(None, description="Constrain the output to one of these strings.")
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._normalize()
        _check_settings(self)
        self._check_rest()

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        _check(all(_is_int(t) for t in (self.stop_token_ids or ())), "stop_token_ids", "a list of token ids",
               self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        for name in ("logprobs", "prompt_logprobs"):  # the old boolean flag: True = the sampled token only
            value = getattr(self, name)
            if value is True:
                object.__setattr__(self, name, 0)
            elif value is False:
                object.__setattr__(self, name, None)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "json_schema", _json_schema(self.json_schema))
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)), "choice", "a list of strings", self.choice)
            object.__setattr__(self, "choice", tuple(self.choice))

    def _check_rest(self) -> None:
        """What the declared types and bounds do not say: list contents, cross-field rules, the grammar."""
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings", self.stop)
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "true or false",
               self.skip_special_tokens)
        _check(self.min_tokens <= self.max_tokens, "min_tokens", f"an integer in 0..max_tokens ({self.max_tokens})",
               self.min_tokens)
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex), "regex", "a non-empty string",
               self.regex)
        _check(self.choice is None or (self.choice and all(isinstance(c, str) and c for c in self.choice)),
               "choice", "a non-empty list of non-empty strings", self.choice)
        given = [k for k in GRAMMAR_FIELDS if getattr(self, k) is not None]
        _check(len(given) <= 1, "/".join(given), "used alone (at most one of json_schema, regex, choice)",
               given)
        # the grammar decides where a structured output ends (it allows only EOS once complete)
        _check(not (given and self.min_tokens), "min_tokens", f"0 with {given[0] if given else ''}",
               self.min_tokens)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def is_structured(self) -> bool:
        """Whether a grammar constrains the output (json_schema, regex or choice)."""
        return self.json_schema is not None or self.regex is not None or self.choice is not None

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict (a job spec or a per-row override), naming any unknown parameter."""
        _check_known(values)
        return cls(**values)

    def with_overrides(self, values: dict[str, Any]) -> SamplingParams:
        """These settings with ``values`` (a per-row override) applied, checked like :meth:`from_dict`. A
        constraint in ``values`` (json_schema, regex or choice) replaces this one's, whichever it was."""
        if not values:
            return self
        _check_known(values)
        if any(k in values for k in GRAMMAR_FIELDS):
            values = {**dict.fromkeys(GRAMMAR_FIELDS), **values}
        return dataclasses.replace(self, **values)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("extra")
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        out["choice"] = list(self.choice) if self.choice is not None else None
        return out


GRAMMAR_FIELDS = ("json_schema", "regex", "choice")  # at most one constrains a request's output


# OpenAI's and vLLM's names of settings written otherwise here: an unknown key says what to write instead
OTHER_NAMES = {"top_logprobs": "logprobs: K (the sampled token and its top K alternatives; logprobs: true is K 0)",
               "max_completion_tokens": "max_tokens", "response_format": "json_schema (the schema itself)",
               "guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
               "stop_sequences": "stop"}


def _check_known(values: dict[str, Any]) -> None:
    known = {f.name for f in fields(SamplingParams)} - {"extra"}
    unknown = sorted(set(values) - known)
    if not unknown:
        return
    hints = [_instead(name, known) for name in unknown]
    if all(hints):
        raise ValueError("; ".join(f"unknown sampling parameter {name!r}: {hint}" for name, hint in
                                   zip(unknown, hints, strict=True)))
    raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _instead(name: Any, known: set[str]) -> str | None:
    """'write X' for an OpenAI / vLLM name or a close misspelling of a known setting; None when neither."""
    if name in OTHER_NAMES:
        return f"write {OTHER_NAMES[name]}"
    close = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.75)
    return f"did you mean {close[0]!r}?" if close else None


# the value types a setting's annotation names, how an error message says them, and the test for them
_KINDS = {int: ("an integer", lambda v: _is_int(v)), float: ("a number", lambda v: _is_number(v)),
          bool: ("true or false", lambda v: isinstance(v, bool))}


def _check_settings(params: SamplingParams) -> None:
    """Each ``setting(...)`` field of a scalar type against its declared type and bounds (the one declaration)."""
    for item in settings_of(SamplingParams):
        kind, optional = _scalar_kind(item.annotation)
        if kind is None:
            continue
        value = getattr(params, item.name)
        if optional and value is None:
            continue
        ok = _KINDS[kind][1](value) and all(_OPS[op](value, bound) for op, bound in item.setting.bounds().items())
        _check(ok, item.name, ("null or " if optional else "") + _expected(kind, item.setting), value)


def _scalar_kind(annotation: Any) -> tuple[type | None, bool]:
    """``(int, False)`` for ``int``, ``(int, True)`` for ``int | None``; ``(None, False)`` for other types."""
    if annotation in _KINDS:
        return annotation, False
    for kind in _KINDS:
        if annotation == kind | None:
            return kind, True
    return None, False


_OPS = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b}


def _expected(kind: type, declared: Setting) -> str:
    """``a number in (0, 1]``, ``an integer in 1..128``, ``an integer >= 0``: the declared bounds in words."""
    name = _KINDS[kind][0]
    low = ("[", declared.ge) if declared.ge is not None else ("(", declared.gt) if declared.gt is not None else None
    if low is not None and declared.le is not None:
        if kind is int and low[0] == "[":
            return f"{name} in {low[1]:g}..{declared.le:g}"
        return f"{name} in {low[0]}{low[1]:g}, {declared.le:g}]"
    if low is not None:
        return f"{name} {'>=' if low[0] == '[' else '>'} {low[1]:g}"
    return f"{name} <= {declared.le:g}" if declared.le is not None else name


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    _check(isinstance(value, dict), "logit_bias", "a mapping of token id -> bias", value)
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"sampling parameter 'logit_bias' keys must be token ids, got {key!r}") from None
        _check(_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS and token >= 0, "logit_bias",
               f"token id >= 0 -> a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", {key: bias})
        out[token] = float(bias)
    return out


def _json_schema(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"sampling parameter 'json_schema' is not valid JSON: {exc}") from None
    _check(isinstance(value, dict), "json_schema", "a JSON schema object (a mapping or its JSON text)", value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, expected: str, got: Any) -> None:
    if not ok:
        raise ValueError(f"sampling parameter {name!r} must be {expected}, got {got!r}")
