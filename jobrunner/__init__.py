"""jobrunner: distributed batch LLM inference with our own continuous-batching engine on torch."""

__version__ = "0.1.0"
