"""Our continuous-batching LLM engine. Imports only torch and transformers (never ray, fsspec, pyarrow)."""

from jobrunner.engine.config import EngineConfig
from jobrunner.engine.contract import WorkerEngine
from jobrunner.engine.pooling import PooledOutput, PoolingParams
from jobrunner.engine.request import RequestMetrics, RequestOutput, TokenLogprob, TopLogprob
from jobrunner.engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "PooledOutput", "PoolingParams", "RequestMetrics", "RequestOutput",
           "SamplingParams", "TokenLogprob", "TopLogprob", "WorkerEngine"]


def __getattr__(name: str):
    # LLMEngine pulls in torch + transformers: import it only when asked for.
    if name == "LLMEngine":
        from jobrunner.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
