"""`jobrunner bench --lora-steps` on the tiny model: every case runs and the table renders."""

from __future__ import annotations

from jobrunner.bench.lora_steps import lora_step_times, render_lora_steps


def test_lora_step_times_on_the_tiny_model(tiny_llama_hf_dir):
    result = lora_step_times(str(tiny_llama_hf_dir), dtype="float32", device="cpu", num_rows=4, num_adapters=2,
                             rank=2, prompt_len=8, repeats=1)
    assert set(result["cases"]) == {"base", "one adapter", "mixed"}
    assert all(c["prefill_ms"] > 0 and c["decode_step_ms"] > 0 for c in result["cases"].values())
    assert result["adapter_bytes"] > 0
    lines = render_lora_steps(result)
    assert lines[2].startswith("base") and "1.00x" in lines[2] and lines[4].startswith("mixed")
