"""Pieces of the sampler: counter-based noise, logits processors (penalties, bias, min_tokens), top-k/top-p/min-p
filtering, log-probabilities, and grammar masks for structured output."""
