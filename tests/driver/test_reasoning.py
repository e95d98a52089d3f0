"""Reasoning traces apart from answers (output.reasoning_parser), per-row chat-template variables, and the
OpenAI batch fields; tokenizers built here carry Qwen3's <think> tokens and gpt-oss's harmony markers (no hub)."""

from __future__ import annotations

import pytest
import torch

from jobrunner.driver.openai_batch import result_lines
from jobrunner.driver.reasoning import Harmony, ThinkTags, choose_parser
from jobrunner.driver.rows import RowRequest, job_output_schema, job_sampling, output_row, to_request
from jobrunner.engine import SamplingParams
from jobrunner.engine.request import RequestMetrics, RequestOutput
from jobrunner.io.reader import ROW_INDEX
from jobrunner.spec import spec_from_dict
from tests.engine.tiny import engine_from_hf, make_hf_model, make_tokenizer

# Qwen3's convention: thinking unless enable_thinking is false, when the template writes an empty block itself
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# DeepSeek-R1 distills: the template opens the block, the model writes the trace and closes it
OPENED_TEMPLATE = THINK_TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}"
                    "<|channel|>final{% endif %}<|message|>{{ m['content'] }}<|end|>{% endfor %}<|start|>assistant")
HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]


@pytest.fixture(scope="module")
def think_tokenizer():
    tok = make_tokenizer()
    tok.add_tokens(["<think>", "</think>"])  # added, not special: decoding keeps them (as in Qwen3's vocabulary)
    tok.chat_template = THINK_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def harmony_tokenizer():
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})  # special: plain decoding drops them
    tok.chat_template = HARMONY_TEMPLATE
    return tok


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_a_closed_think_block_is_the_trace_and_its_tokens_are_counted_exactly(think_tokenizer):
    parser = ThinkTags(think_tokenizer)
    ids = _ids(think_tokenizer, "<think>the fox jumps</think>\n\nHello there")
    split = parser.split(think_tokenizer.decode(ids), ids)
    assert (split.reasoning, split.answer) == ("the fox jumps", "Hello there")
    assert split.num_reasoning_tokens == ids.index(parser.close_id) + 1  # up to and including </think>
    assert split.num_reasoning_tokens == len(_ids(think_tokenizer, "<think>the fox jumps</think>"))


def test_a_block_the_template_opened_and_a_block_never_closed(think_tokenizer):
    parser = ThinkTags(think_tokenizer)
    prompt = _ids(think_tokenizer, "<|im_start|>assistant\n<think>\n")
    ids = _ids(think_tokenizer, "quick brown</think>answer")  # the output holds only the block's end
    split = parser.split(think_tokenizer.decode(ids), ids, prompt)
    assert (split.reasoning, split.answer) == ("quick brown", "answer")
    assert split.num_reasoning_tokens == ids.index(parser.close_id) + 1
    cut = _ids(think_tokenizer, "<think>the fox jumps over the")  # max_tokens reached inside the block
    split = parser.split(think_tokenizer.decode(cut), cut)
    assert (split.reasoning, split.answer, split.num_reasoning_tokens) == ("the fox jumps over the", "", len(cut))
    plain = _ids(think_tokenizer, "just an answer")  # no block (thinking off): all answer
    assert parser.split("just an answer", plain, _ids(think_tokenizer, "<think>\n\n</think>\n\n")).reasoning is None


def test_harmony_channels_split_from_the_raw_token_stream(harmony_tokenizer):
    parser = Harmony(harmony_tokenizer)
    raw = ("<|channel|>analysis<|message|>add two and two<|end|><|start|>assistant<|channel|>final<|message|>"
           "four<|return|>")
    ids = _ids(harmony_tokenizer, raw)
    plain = harmony_tokenizer.decode(ids, skip_special_tokens=True)  # what the engine's text holds
    assert "<|channel|>" not in plain
    split = parser.split(plain, ids)
    assert (split.reasoning, split.answer) == ("add two and two", "four")
    assert split.num_reasoning_tokens == ids.index(harmony_tokenizer.convert_tokens_to_ids("<|channel|>"), 1)
    unfinished = _ids(harmony_tokenizer, "<|channel|>analysis<|message|>still thinking")
    split = parser.split(harmony_tokenizer.decode(unfinished, skip_special_tokens=True), unfinished)
    assert (split.reasoning, split.answer, split.num_reasoning_tokens) == ("still thinking", "", len(unfinished))


def test_auto_reads_the_chat_template(think_tokenizer, harmony_tokenizer):
    assert isinstance(choose_parser("auto", think_tokenizer), ThinkTags)
    assert isinstance(choose_parser("auto", harmony_tokenizer), Harmony)
    assert choose_parser("auto", make_tokenizer()) is None  # no convention in the template: no parsing
    assert choose_parser("auto", None, chat_template=THINK_TEMPLATE).tokenizer is None  # the job's template
    assert choose_parser("none", think_tokenizer) is None
    with pytest.raises(ValueError, match="unknown parser 'qwen'"):
        choose_parser("qwen", think_tokenizer)


def _spec(**sections):
    base = {"name": "t", "input": {"url": "x", "messages_column": "m", "id_column": "id"}, "output": {"url": "o"},
            "sampling": {"max_tokens": 8}}
    for key, value in sections.items():
        base[key] = {**base[key], **value}
    return spec_from_dict(base)


def _out(tok, text: str, reason: str = "stop") -> RequestOutput:
    ids = _ids(tok, text)
    return RequestOutput(request_id="r", prompt_token_ids=[1], output_token_ids=ids, text=tok.decode(ids),
                         finish_reason=reason, error=None, metrics=RequestMetrics(arrival_time=0.0))


def test_output_rows_hold_the_answer_the_trace_and_its_tokens(think_tokenizer):
    spec = _spec(output={"format": "messages"})
    assert {"reasoning", "num_reasoning_tokens"} <= set(job_output_schema(spec).names)
    req = RowRequest("a", 0, [{"role": "user", "content": "hi"}], job_sampling(spec))
    row = output_row(spec, req, _out(think_tokenizer, "<think>the fox</think>Hello"), ThinkTags(think_tokenizer))
    trace_ids = len(_ids(think_tokenizer, "<think>the fox</think>"))
    assert (row["generated_text"], row["reasoning"], row["num_reasoning_tokens"]) == ("Hello", "the fox", trace_ids)
    assert row["messages"][-1] == {"role": "assistant", "content": "Hello"}  # fine-tuning data: the answer
    no_parser = output_row(spec, req, _out(think_tokenizer, "plain"), None)  # auto found no convention
    assert (no_parser["reasoning"], no_parser["num_reasoning_tokens"]) == (None, None)
    off = _spec(output={"reasoning_parser": "none"})
    assert "reasoning" not in job_output_schema(off).names
    raw = output_row(off, req, _out(think_tokenizer, "<think>x</think>y"), ThinkTags(think_tokenizer))
    assert raw["generated_text"] == "<think>x</think>y" and "reasoning" not in raw


def test_openai_results_carry_reasoning_content_and_reasoning_tokens():
    row = {"id": "q1", "sample_index": 0, "generated_text": "four", "finish_reason": "stop", "error": None,
           "num_prompt_tokens": 10, "num_output_tokens": 12, "ttft_s": 0.1, "logprobs": None,
           "reasoning": "add two and two", "num_reasoning_tokens": 9}
    outputs, errors = result_lines([row], {"q1": "chat"}, "m", "job")
    body = outputs[0]["response"]["body"]
    assert not errors and body["choices"][0]["message"] == {"role": "assistant", "content": "four",
                                                            "reasoning_content": "add two and two"}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 9}
    from openai.types.chat import ChatCompletion  # the openai package's own types read the line

    parsed = ChatCompletion.model_validate(body)
    assert parsed.usage.completion_tokens_details.reasoning_tokens == 9


def test_per_row_chat_template_variables_merge_over_the_jobs():
    spec = _spec(input={"chat_template_kwargs": {"enable_thinking": True, "style": "short"},
                        "chat_template_kwargs_column": "tk"})
    sampling = job_sampling(spec)
    row = {ROW_INDEX: 0, "id": "a", "m": '[{"role": "user", "content": "hi"}]', "tk": '{"enable_thinking": false}'}
    assert to_request(spec, "f", row, sampling).chat_template_kwargs == {"enable_thinking": False, "style": "short"}
    assert to_request(spec, "f", {**row, "tk": None}, sampling).chat_template_kwargs == {
        "enable_thinking": True, "style": "short"}
    bad = to_request(spec, "f", {**row, "tk": "[1, 2]"}, sampling)
    assert bad.error.startswith("chat template kwargs column 'tk': ")


def test_the_real_engine_with_thinking_on_and_off(think_tokenizer):
    # a tiny random model made to write a think block by a regex (structured output), then the worker's split;
    # with enable_thinking false the template closes the block in the prompt and the output is all answer
    torch.manual_seed(0)
    hf = make_hf_model("llama", vocab_size=len(think_tokenizer))
    engine = engine_from_hf(hf, think_tokenizer, block_size=4)
    parser = choose_parser("auto", engine.tokenizer)
    assert isinstance(parser, ThinkTags) and parser.close_id == think_tokenizer.convert_tokens_to_ids("</think>")
    chat = [{"role": "user", "content": "Hello there"}]
    forced = SamplingParams(max_tokens=40, regex=r"<think>[a-z ]{2,12}</think>[a-z]{1,6}", ignore_eos=False)
    out = engine.generate([chat], forced)[0]
    split = parser.split(out.text, out.output_token_ids, out.prompt_token_ids)
    assert out.text == f"<think>{split.reasoning}</think>{split.answer}" and split.reasoning and split.answer
    # the grammar spelt </think> in characters, not as its token: counted in the ids the model wrote
    cut = next(k for k in range(len(out.output_token_ids) + 1)
               if "</think>" in think_tokenizer.decode(out.output_token_ids[:k]))
    assert split.num_reasoning_tokens == cut
    engine.add_request("off", chat, SamplingParams(max_tokens=6, regex=r"[a-z]{1,6}"),
                       chat_template_kwargs={"enable_thinking": False})
    off = [o for o in _drain(engine) if o.request_id == "off"][0]
    assert think_tokenizer.decode(off.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    split = parser.split(off.text, off.output_token_ids, off.prompt_token_ids)
    assert (split.reasoning, split.answer, split.num_reasoning_tokens) == (None, off.text, 0)
    opened = ThinkTags(think_tokenizer)  # an R1-style prompt that opens the block: the output's trace is found
    prompt = _ids(think_tokenizer, "<|im_start|>assistant\n<think>\n")
    assert opened.split("abc</think>d", _ids(think_tokenizer, "abc</think>d"), prompt).reasoning == "abc"


def _drain(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs
