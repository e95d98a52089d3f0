"""Prefill-only requests (engine/pooling.py) against transformers on tiny random models: embeddings against
``AutoModel`` (last-token and mean pooling), scores against ``AutoModelForSequenceClassification``,
completion log-likelihoods against a causal LM's forward; through chunked prefill, prefix-cache hits and
preemption. Each parity test prints its max abs diff."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_checked
from tiny import CORPUS, engine_from_hf

from jobrunner.engine import EngineConfig, PoolingParams, SamplingParams
from jobrunner.engine.llm_engine import LLMEngine

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
# chunks of 16 tokens and blocks of 4: every prompt here is prefilled over several steps, and shares blocks
ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=256)
PROMPTS = [CORPUS[1], CORPUS[1][:60], CORPUS[2], CORPUS[1]]  # a repeat and a shared prefix: cache hits


def _save(model, tokenizer, path, modules=None, pooling=None):
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    if modules is not None:
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(path)


def _hf(cls_name: str, **extra):
    import transformers

    config = transformers.LlamaConfig(**TINY, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model


def _run(engine, prompts, params):
    outs = run_checked(engine, prompts, params)
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer):
    """A bare LlamaModel (AutoModel) saved as sentence-transformers would: mean pooling, then Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    hf = _hf("LlamaModel")
    return hf, _save(hf, tokenizer, tmp_path_factory.mktemp("llama_model"), modules, pooling)


def test_embeddings_match_automodel(base_dir, tokenizer):
    hf, path = base_dir
    engine = LLMEngine.from_source(path, config=EngineConfig(**ENGINE))
    info = engine.model_info
    assert (info["head"], info["pooling"], info["normalize"], info["hidden_size"]) == ("none", "mean", True, 64)
    last = _run(engine, PROMPTS, PoolingParams(task="embed", pooling="last"))
    mean = _run(engine, PROMPTS, PoolingParams(task="embed", pooling="mean", normalize=True))
    cls = _run(engine, PROMPTS, PoolingParams(task="embed", pooling="cls"))
    diffs = []
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            hidden = hf(torch.tensor([ids])).last_hidden_state[0].float()
        want_mean = torch.nn.functional.normalize(hidden.mean(0), dim=-1)
        diffs += [(torch.tensor(last[i].pooled.embedding) - hidden[-1]).abs().max().item(),
                  (torch.tensor(mean[i].pooled.embedding) - want_mean).abs().max().item(),
                  (torch.tensor(cls[i].pooled.embedding) - hidden[0]).abs().max().item()]
        assert last[i].output_token_ids == [] and last[i].finish_reason == "stop"
        assert last[i].metrics.num_prompt_tokens == len(ids) and last[i].metrics.ttft_s is not None
        assert mean[i].metrics.num_cached_tokens == 0  # mean pooling reads every position: never a cache hit
    print(f"embedding parity vs AutoModel (last, mean+normalize, cls): max abs diff {max(diffs):.2e}")
    assert max(diffs) < 1e-4
    assert last[3].metrics.num_cached_tokens > 0  # the repeated prompt's last-token embedding reused its blocks


def test_scores_match_sequence_classification(tmp_path, tokenizer):
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    hf = _hf("LlamaForSequenceClassification", num_labels=3, id2label=labels,
             label2id={v: k for k, v in labels.items()})
    engine = LLMEngine.from_source(_save(hf, tokenizer, tmp_path), config=EngineConfig(**ENGINE))
    assert engine.model_info["labels"] == ["negative", "neutral", "positive"]
    outs = _run(engine, PROMPTS, PoolingParams(task="classify"))
    diffs = []
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf(torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0].float()
        assert len(out.pooled.scores) == 3
        diffs.append((torch.tensor(out.pooled.scores) - want).abs().max().item())
    print(f"score parity vs AutoModelForSequenceClassification: max abs diff {max(diffs):.2e}")
    assert max(diffs) < 1e-4
    # a classifier has no LM head (untied): a log-likelihood request is that request's error
    bad = _run(engine, ["hello"], PoolingParams(task="loglik", completion=" world"))[0]
    assert bad.finish_reason == "error" and "language-model head" in bad.error


def test_completion_loglik_matches_forward(tokenizer, hf_llama):
    engine = engine_from_hf(hf_llama, tokenizer, block_size=4, max_num_batched_tokens=16)
    prompt = CORPUS[2]
    completions = [" She earned $10.", " She earned nothing at all, sadly.", " She earned $10."]
    outs = _run(engine, [prompt] * 3, [PoolingParams(task="loglik", completion=c) for c in completions])
    prompt_ids = tokenizer(prompt)["input_ids"]
    diffs = []
    for completion, out in zip(completions, outs):
        ids = prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = hf_llama(torch.tensor([ids])).logits[0, :-1].float()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        want = want[len(prompt_ids) - 1:]
        got = torch.tensor(out.pooled.completion_logprobs)
        assert got.shape == want.shape
        diffs.append((got - want).abs().max().item())
        assert abs(out.pooled.completion_logprob - want.sum().item()) < 1e-3
    print(f"log-likelihood parity vs a causal LM forward: max abs diff {max(diffs):.2e}")
    assert max(diffs) < 1e-4
    # the later rows reused the shared prompt's blocks, never the position that predicts the completion
    cached = [o.metrics.num_cached_tokens for o in outs[1:]]
    assert all(0 < c <= len(prompt_ids) - 1 for c in cached)


def test_preempted_pooling_requests_start_clean(tokenizer, hf_llama):
    """Generations growing in a pool too small for all: embedding requests are preempted mid-prefill and
    recomputed; their mean embeddings still equal a run alone."""
    alone = engine_from_hf(hf_llama, tokenizer, block_size=4, max_num_batched_tokens=16, num_kv_blocks=64)
    tight = engine_from_hf(hf_llama, tokenizer, block_size=4, max_num_batched_tokens=16, num_kv_blocks=16)
    gen, pool = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), PoolingParams(pooling="mean")
    prompts = ["hi there", CORPUS[1], "the fox", CORPUS[2], CORPUS[3]]
    outs = _run(tight, prompts, [gen, pool, gen, pool, pool])
    assert sum(o.metrics.num_preemptions for o in outs[1::2] + outs[4:]) > 0  # pooling rows were preempted
    for prompt, out in zip(prompts[1::2] + prompts[4:], outs[1::2] + outs[4:]):
        want = _run(alone, [prompt], pool)[0].pooled.embedding
        assert torch.allclose(torch.tensor(out.pooled.embedding), torch.tensor(want), atol=1e-5)
