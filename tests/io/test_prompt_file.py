"""Benchmark prompt files: a bad line (bytes, JSON, a value of the wrong type) is named by its line."""

from __future__ import annotations

import pytest

from jobrunner.io.prompt_file import PromptFileError, read_prompts


def test_prompts_and_bad_lines_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert read_prompts(path) == ["a", [{"role": "user", "content": "b"}]]
    path.write_bytes(b'{"prompt": "a"}\n\n{"prompt": "b\xff"}\n')
    with pytest.raises(PromptFileError, match=r"line 3: not valid UTF-8 \(invalid start byte at byte 13\)"):
        read_prompts(path)
    path.write_bytes(b'{"prompt": "a"}\n\n{"prompt": 5}\n')
    with pytest.raises(PromptFileError, match=r"line 3: 'prompt' must be a string, got int"):
        read_prompts(path)
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(PromptFileError, match=r"line 2: not JSON"):
        read_prompts(path)
