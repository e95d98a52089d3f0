"""Structured output: a grammar (JSON schema, regex or a fixed choice) masks the logits every step.

Backed by xgrammar (chosen by measured per-step mask cost, see docs/engine.md): the schema is compiled once per
distinct spec (the compiler caches), each sample gets its own matcher, and every step the sampler refreshes
the device mask rows of the constrained samples whose grammar moved and masks the batch's logits in one call
(:mod:`jobrunner.engine.sampling.grammar_masks`). The matcher only allows
EOS once the grammar is complete, so the output always ends where the grammar does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

import torch

from jobrunner.engine.sampling_params import SamplingParams

# Schema keywords the grammar cannot enforce (xgrammar accepts some of them silently): refused, so that every
# output that parses also validates.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "uniqueItems",
    "contains", "minContains", "maxContains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
    "multipleOf", "patternProperties",
})
MAX_CACHED_GRAMMARS = 256
_NAMED_SCHEMAS = ("properties", "$defs", "definitions")   # maps of name -> schema (names are not keywords)
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: "


def check_schema_keywords(schema, where: str = "#") -> None:
    """Raise ValueError naming the first keyword the grammar cannot enforce, with its JSON pointer."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema_keywords(item, f"{where}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in UNSUPPORTED_KEYWORDS:
            raise ValueError(f"sampling parameter 'json_schema' uses {key!r} at {where}, which structured "
                             "output cannot enforce")
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema_keywords(sub, f"{where}/{key}/{name}")
        elif isinstance(value, (dict, list)) and key not in ("enum", "const", "default", "examples"):
            check_schema_keywords(value, f"{where}/{key}")


class GrammarUnavailable(ValueError):
    """Structured output was asked for but xgrammar is not installed."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # an optional extra: say so per request instead of failing the engine
        raise GrammarUnavailable(
            "structured output (json_schema/regex/choice) needs xgrammar: pip install 'jobrunner[structured]'"
        ) from exc
    return xgrammar


def structured_grammar(params: SamplingParams):
    """The grammar of ``params``' constraint (json_schema, regex or choice), built without a tokenizer.

    The one place a constraint is checked: the worker's :class:`GrammarCompiler` compiles what this returns,
    and ``jobrunner validate`` calls it on every row it reads (driver/row_check.py), so a schema the worker
    would refuse is refused before any worker starts. ValueError names the field and xgrammar's reason;
    :class:`GrammarUnavailable` when xgrammar is not installed.
    """
    xgr = _xgrammar()
    if params.json_schema is not None:
        check_schema_keywords(params.json_schema)
        build = lambda: xgr.Grammar.from_ebnf(_json_schema_ebnf(xgr, params.json_schema))  # noqa: E731
    elif params.regex is not None:
        build = lambda: xgr.Grammar.from_regex(params.regex)  # noqa: E731
    else:
        # an EBNF alternation of string literals (JSON escapes are valid EBNF escapes)
        rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        build = lambda: xgr.Grammar.from_ebnf(f"root ::= {rule}")  # noqa: E731
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses with a reason
        raise ValueError(f"sampling parameter {_constrained_field(params)!r} is invalid or unsupported: "
                         f"{_reason(exc)}") from None


def _json_schema_ebnf(xgr, schema: dict) -> str:
    # xgrammar (0.2.x) writes strings with minLength/maxLength as repeats of [^"\\\r\n], which lets raw
    # control characters through (invalid JSON); give them the same character class as its plain strings
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def _constrained_field(params: SamplingParams) -> str:
    return "json_schema" if params.json_schema is not None else "regex" if params.regex is not None else "choice"


def _reason(exc: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix, first line only."""
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__


class Grammar:
    """One sample's grammar state: which tokens may come next, advanced by every accepted token."""

    def __init__(self, matcher, compiler: GrammarCompiler) -> None:
        self.matcher = matcher
        self.compiler = compiler  # applies the batch's masks
        self.num_accepted = 0     # tokens accepted so far: the mask changes only when this does

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (the mask should make that impossible)."""
        if self.matcher.is_terminated():
            return True
        accepted = bool(self.matcher.accept_token(token_id))
        self.num_accepted += accepted
        return accepted

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer and vocabulary (the model's, maybe padded)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgrammar = _xgrammar()
        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._compiled: dict[str, object] = {}

    def factory(self, params: SamplingParams) -> Callable[[], Grammar]:
        """A maker of fresh matchers for ``params``' spec; ``ValueError`` naming the field if the spec is bad."""
        key = json.dumps([params.json_schema, params.regex, params.choice], sort_keys=True)
        compiled = self._compiled.get(key)
        if compiled is None:  # rows of a job usually share one spec: convert and compile it once
            compiled = self._compiled[key] = self._compile(params)
            if len(self._compiled) > MAX_CACHED_GRAMMARS:  # per-row specs: keep the newest only
                del self._compiled[next(iter(self._compiled))]
        return lambda: Grammar(self._xgr.GrammarMatcher(compiled), self)

    def _compile(self, params: SamplingParams):
        grammar = structured_grammar(params)  # ValueError naming the field: the row's error
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses with a reason
            raise ValueError(f"sampling parameter {_constrained_field(params)!r} is invalid or unsupported: "
                             f"{_reason(exc)}") from None

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Set ``logits[r, j]`` to ``-inf`` in place where bit j of ``bitmask[r]`` is 0, for each r in ``rows``
        (``bitmask``: ``[len(logits), ceil(vocab / 32)]`` int32, ``rows`` int32, both on the logits' device)."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
