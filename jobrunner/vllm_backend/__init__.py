"""`engine.backend: vllm`: vLLM's engine behind the worker engine contract, in its own process."""
