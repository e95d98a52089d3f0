"""Chat template options: kwargs passed to apply_chat_template, and a template override."""

from tiny import engine_from_hf

from jobrunner.engine import SamplingParams

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}fox{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hello there"}]


def prompt_ids(engine, **kwargs) -> list[int]:
    engine.add_request("q", MESSAGES, SamplingParams(max_tokens=1, temperature=0), **kwargs)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[0].prompt_token_ids


def test_template_override_and_kwargs(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer)
    default = prompt_ids(engine)
    engine.set_chat_template(THINKING_TEMPLATE)
    thinking = prompt_ids(engine)
    no_thinking = prompt_ids(engine, chat_template_kwargs={"enable_thinking": False})
    expected = tokenizer(tokenizer.apply_chat_template(MESSAGES, chat_template=THINKING_TEMPLATE, tokenize=False,
                                                       enable_thinking=False), add_special_tokens=False)["input_ids"]
    assert no_thinking == expected
    assert thinking == default  # same text as the tokenizer's own template when thinking stays on
    assert tokenizer.decode(no_thinking).endswith("assistant\nfox")
    engine.set_chat_template(None)
    assert prompt_ids(engine) == default
