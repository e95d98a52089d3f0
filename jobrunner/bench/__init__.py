"""`jobrunner bench`: our engine vs transformers' ``generate`` on the same tokenized prompts, in one process.

Modules: ``prompts`` (tokenize once), ``ours`` (our engine), ``hf_baseline`` (static left-padded batches),
``result`` (counters and memory), ``runner`` (the whole comparison), ``report`` (text table and JSON).
"""

from jobrunner.bench.result import RunResult
from jobrunner.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "RunResult", "run_bench"]
