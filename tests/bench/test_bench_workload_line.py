"""The bench report's workload line names a tensor-parallel run (a TP 1 / TP 2 pair must read apart)."""

from jobrunner.bench.report import _workload_line

WORKLOAD = {"num_prompts": 8, "num_dropped_too_long": 0, "max_tokens": 16, "ignore_eos": True, "model": "m",
            "dtype": "bfloat16", "device": "cpu", "quantization": "none", "max_num_seqs": 64,
            "attention_backend": "cpu_paged"}


def test_workload_line_names_tensor_parallel():
    line = _workload_line({**WORKLOAD, "tensor_parallel_size": 2})
    assert line.endswith("max_num_seqs 64, attention cpu_paged, tensor parallel 2")


def test_workload_line_one_rank_and_older_results_unchanged():
    expected = ("8 prompts (0 dropped: too long), max_tokens 16 (ignore_eos), model m bfloat16 on cpu, "
                "quantization none, max_num_seqs 64, attention cpu_paged")
    assert _workload_line({**WORKLOAD, "tensor_parallel_size": 1}) == expected
    assert _workload_line(WORKLOAD) == expected
