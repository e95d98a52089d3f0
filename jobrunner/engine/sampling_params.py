"""Per-request sampling settings, validated at the API boundary."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible for this request whatever it is
    batched with (the random stream depends only on the seed and the output position). ``stop`` strings are
    matched on the decoded text (also across token boundaries) and removed from the output.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1",
               self.max_tokens)
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0",
               self.temperature)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)", self.top_k)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an integer or null", self.seed)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings", self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict (a job spec or a per-row override), naming any unknown parameter."""
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("extra")
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, expected: str, got: Any) -> None:
    if not ok:
        raise ValueError(f"sampling parameter {name!r} must be {expected}, got {got!r}")
