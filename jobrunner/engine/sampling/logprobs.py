"""Log-probabilities of sampled / prompt tokens and their top-K alternatives, and their token texts.

Values are the model's own distribution: log-softmax of the raw logits (before temperature, penalties, bias
or grammar masks), as vLLM and OpenAI report them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import torch

from jobrunner.engine.request import TokenLogprob, TopLogprob

# (token_id, logprob, [(alt_id, alt_logprob), ...]) as it comes off the device
LogprobEntry = tuple[int, float, list[tuple[int, float]]]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """``[N, 1 + 2k]`` float64: each row's token logprob, then its top-k logprobs, then their ids."""
    chosen = logprobs.gather(1, token_ids[:, None])
    if k == 0:
        return chosen.double()
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([chosen, top_values, top_ids.to(logprobs.dtype)], dim=1).double()


def unpack(token_id: int, row: Sequence[float], k: int, k_max: int) -> LogprobEntry:
    """One row of :func:`gather_logprobs` (computed with ``k_max``) cut to this request's ``k``."""
    alts = [(int(row[1 + k_max + j]), row[1 + j]) for j in range(k)]
    return token_id, row[0], alts


class TokenTexts:
    """Decoded text and raw bytes of single tokens, cached (a top-20 list would otherwise decode 21 tokens per
    step)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._bytes_of: TokenBytes | None = None  # built on first use

    def __call__(self, token_id: int) -> str:
        return self.text_and_bytes(token_id)[0]

    def text_and_bytes(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            if self._bytes_of is None:
                self._bytes_of = TokenBytes(self.tokenizer)
            text = self.tokenizer.decode([token_id])
            hit = self._cache[token_id] = (text, self._bytes_of(token_id, text))
        return hit

    def entry(self, entry: LogprobEntry) -> TokenLogprob:
        token_id, logprob, alts = entry
        top = []
        for alt_id, alt_logprob in alts:
            alt_text, alt_bytes = self.text_and_bytes(alt_id)
            top.append(TopLogprob(alt_id, alt_text, alt_logprob, token_bytes=alt_bytes))
        text, raw = self.text_and_bytes(token_id)
        return TokenLogprob(token_id, text, logprob, top, token_bytes=raw)


def _gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte as the printable character that stands for it in the vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _gpt2_byte_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


class TokenBytes:
    """The raw bytes of a token, from its vocabulary piece.

    Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2: the tokenizer's decoder is ``ByteLevel``): each character of
    the piece stands for one byte. SentencePiece (``▁`` for a space; ``<0xNN>`` byte-fallback pieces): the
    piece with ``▁`` as a space, or that one byte. Added/special tokens and anything else: the UTF-8 of the
    decoded text (right for every token that is whole characters).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())

    def __call__(self, token_id: int, text: str) -> bytes:
        fallback = text.encode("utf-8")
        if token_id in self._added:
            return fallback
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # an id past the tokenizer's vocabulary (a padded embedding row)
            return fallback
        if not isinstance(piece, str) or not piece:
            return fallback
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if self.kind == "byte_level" and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if self.kind == "metaspace":
            return piece.replace("\u2581", " ").encode("utf-8")
        return fallback


def _decoder_kind(tokenizer) -> str:
    """``byte_level``, ``metaspace`` or ``text``, from the fast tokenizer's decoder (``text`` if none)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return "text"
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:
        return "text"
    types, strings = set(), set()

    def walk(node) -> None:
        if isinstance(node, dict):
            types.add(node.get("type"))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            strings.add(node)

    walk(spec)
    if "ByteLevel" in types:
        return "byte_level"
    if "Metaspace" in types or "\u2581" in strings:
        return "metaspace"
    return "text"


def prompt_logprob_entries(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[LogprobEntry | None]:
    """Entries for every prompt token from ``logits`` ``[T, V]`` (row i predicts token i + 1); first is None."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(list(token_ids[1:]), device=logits.device)
    rows = gather_logprobs(logprobs, targets, k).tolist()
    return [None] + [unpack(t, row, k, k) for t, row in zip(token_ids[1:], rows)]
