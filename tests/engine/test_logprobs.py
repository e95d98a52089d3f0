"""Top-K logprobs of output and prompt tokens against transformers' log-softmax on the tiny Llama; the raw
bytes of each token (byte-level BPE and SentencePiece byte pieces)."""

import pytest
import torch
from tiny import CORPUS, engine_from_hf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jobrunner.engine import SamplingParams
from jobrunner.engine.sampling.logprobs import TokenTexts


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """``[T, V]`` log-softmax of transformers' logits: row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entry(entry, expected_row: torch.Tensor, k: int, tokenizer) -> None:
    assert entry.logprob == pytest.approx(expected_row[entry.token_id].item(), abs=1e-4)
    assert entry.token == tokenizer.decode([entry.token_id])
    top_values, top_ids = expected_row.topk(k)
    assert [t.token_id for t in entry.top_logprobs] == top_ids.tolist()
    assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
    assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for i in top_ids.tolist()]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_output_top_logprobs_match_transformers(hf_llama, tokenizer, temperature):
    engine = engine_from_hf(hf_llama, tokenizer, block_size=4)
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, logprobs=5, ignore_eos=True,
                            repetition_penalty=1.3)  # processors do not change the reported distribution
    out = engine.generate([CORPUS[1]], params)[0]
    expected = hf_logprobs(hf_llama, out.prompt_token_ids + out.output_token_ids)
    start = len(out.prompt_token_ids) - 1
    assert [e.token_id for e in out.logprobs] == out.output_token_ids
    for i, entry in enumerate(out.logprobs):
        check_entry(entry, expected[start + i], 5, tokenizer)


def test_prompt_logprobs_match_transformers(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer)
    outs = engine.generate([CORPUS[0]], SamplingParams(max_tokens=2, temperature=0, n=2, prompt_logprobs=3))
    prompt = outs[0].prompt_token_ids
    expected = hf_logprobs(hf_llama, prompt)
    entries = outs[0].prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    for i, entry in enumerate(entries[1:]):
        check_entry(entry, expected[i], 3, tokenizer)
    assert outs[1].prompt_logprobs == entries  # computed once, shared by the samples
    assert outs[0].logprobs is None


def test_mixed_k_in_one_batch(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer)
    ks = [None, 0, 2, 20]
    outs = engine.generate([CORPUS[2]] * 4, [SamplingParams(max_tokens=3, temperature=0, logprobs=k) for k in ks])
    assert outs[0].logprobs is None
    for k, out in zip(ks[1:], outs[1:]):
        assert len(out.logprobs) == 3 and all(len(e.top_logprobs) == k for e in out.logprobs)
    assert outs[1].logprobs[0].logprob == outs[3].logprobs[0].logprob


@pytest.mark.parametrize("value", [-1, 21, 2.5, "5"])
def test_bad_logprobs_is_named(value):
    with pytest.raises(ValueError, match="'logprobs'"):
        SamplingParams(logprobs=value)
    with pytest.raises(ValueError, match="'prompt_logprobs'"):
        SamplingParams(prompt_logprobs=value)


def test_boolean_logprobs_still_accepted():
    assert SamplingParams(logprobs=True).logprobs == 0
    assert SamplingParams(logprobs=False).logprobs is None


SPLIT_TEXT = "é café 😀 naïve"  # the tiny tokenizer splits é, ï and the emoji into single-byte tokens


def test_token_bytes_of_byte_level_bpe_pieces(tokenizer):
    ids = tokenizer(SPLIT_TEXT, add_special_tokens=False)["input_ids"]
    texts = TokenTexts(tokenizer)
    pairs = [texts.text_and_bytes(i) for i in ids]
    assert sum(text == "\ufffd" for text, _ in pairs) >= 4  # pieces of characters: their text says nothing
    assert b"".join(raw for _, raw in pairs) == SPLIT_TEXT.encode()
    assert pairs[0] == ("\ufffd", b"\xc3") and pairs[1] == ("\ufffd", b"\xa9")  # é = C3 A9, one token each
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert texts.text_and_bytes(im_end) == ("<|im_end|>", b"<|im_end|>")  # added tokens: their text


def sentencepiece_byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: ▁ for spaces, <0xNN> byte pieces for characters outside the vocabulary."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁", "c", "a", "f", "▁c", "▁ca", "▁caf"):
        vocab[piece] = len(vocab)
    merges = [("▁", "c"), ("▁c", "a"), ("▁ca", "f")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_token_bytes_of_sentencepiece_byte_pieces():
    sp = sentencepiece_byte_fallback_tokenizer()
    ids = sp("café", add_special_tokens=False)["input_ids"]
    assert sp.convert_ids_to_tokens(ids) == ["▁caf", "<0xC3>", "<0xA9>"]
    texts = TokenTexts(sp)
    assert [texts.text_and_bytes(i) for i in ids] == [("caf", b" caf"), ("\ufffd", b"\xc3"), ("\ufffd", b"\xa9")]


def test_engine_logprobs_carry_token_bytes(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = engine.generate([SPLIT_TEXT], params)[0]
    texts = TokenTexts(tokenizer)
    first = texts.text_and_bytes(out.prompt_token_ids[0])[1]
    assert first + b"".join(e.token_bytes for e in out.prompt_logprobs[1:]) == SPLIT_TEXT.encode()
    for entry in out.prompt_logprobs[1:] + out.logprobs:
        assert (entry.token, entry.token_bytes) == texts.text_and_bytes(entry.token_id)
        assert all((t.token, t.token_bytes) == texts.text_and_bytes(t.token_id) for t in entry.top_logprobs)
