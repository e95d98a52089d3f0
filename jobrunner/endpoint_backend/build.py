"""Build a worker's endpoint engine from a job spec: the endpoint's settings, the API key (from the spec's
`${env:NAME}` or $OPENAI_API_KEY, cut by value from everything this process writes), a tokenizer for the token
estimates when one is on this machine, the token prices and this worker's share of the spending cap."""

from __future__ import annotations

import os
from typing import Any

from jobrunner.endpoint_backend.engine import EndpointConfig, EndpointEngine
from jobrunner.endpoint_backend.transport import Transport
from jobrunner.redaction import remember_secrets

API_KEY_ENV = "OPENAI_API_KEY"


def build_endpoint_engine(spec: Any) -> EndpointEngine:
    """The endpoint engine of one worker (ValueError naming the field when the endpoint is not set)."""
    endpoint = spec.engine.endpoint
    if endpoint is None:
        raise ValueError("engine.backend openai needs engine.endpoint: {base_url, model}")
    api_key = endpoint.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key:
        remember_secrets([api_key])  # whatever its shape: cut by value from every text this process writes
    cost = spec.cost
    config = EndpointConfig(
        base_url=endpoint.base_url, model=endpoint.model, max_concurrency=endpoint.max_concurrency,
        requests_per_minute=endpoint.requests_per_minute, tokens_per_minute=endpoint.tokens_per_minute,
        max_retries=endpoint.max_retries, timeout_s=endpoint.timeout_s, stream=endpoint.stream,
        usd_per_m_input=cost.usd_per_m_input or 0.0, usd_per_m_output=cost.usd_per_m_output or 0.0,
        max_usd=None if cost.max_usd is None else cost.max_usd / spec.cluster.num_workers)
    tokenizer, where = estimate_tokenizer(endpoint.tokenizer or spec.model.source)
    info = {"source": f"{endpoint.model} at {endpoint.base_url}", "endpoint": endpoint.base_url,
            "token_estimate": where}
    return EndpointEngine(config, Transport(endpoint.base_url, api_key, endpoint.timeout_s), tokenizer, info,
                          chat_template=spec.input.chat_template)


def estimate_tokenizer(source: str | None) -> tuple[Any, str]:
    """(a tokenizer already on this machine for `source`, or None; what the estimates use, in words)."""
    from jobrunner.driver.length_check import local_tokenizer_dir

    path = local_tokenizer_dir(source) if source else None
    if path is None:
        return None, "characters / 4"
    from jobrunner.models.weights import load_tokenizer

    try:
        return load_tokenizer(path), f"the tokenizer of {source}"
    except Exception:  # noqa: BLE001 - an unreadable tokenizer: estimates from characters still work
        return None, "characters / 4"
