"""What an `engine.backend: openai` job may not ask for, checked when the spec is loaded (jobrunner.spec calls
`endpoint_problems`; plain attribute reads, so this module imports nothing of the spec's)."""

from __future__ import annotations

from typing import Any


def endpoint_problems(spec: Any) -> list[str]:
    """One line per setting that does not fit the job's backend (empty when all fit)."""
    engine, cost = spec.engine, spec.cost
    if engine.backend != "openai":
        problems = ["engine.endpoint applies to engine.backend openai only"] if engine.endpoint else []
        if cost.max_usd is not None:
            problems.append("cost.max_usd applies to engine.backend openai (it counts the endpoint's tokens at "
                            "cost.usd_per_m_input / usd_per_m_output)")
        return problems
    problems = []
    if engine.endpoint is None:
        problems.append("engine.backend openai needs engine.endpoint: {base_url, model} (docs/endpoints.md)")
    if engine.factory:
        problems.append("engine.factory and engine.backend openai both build the engine: set one")
    if spec.task != "generate":
        problems.append(f"engine.backend openai runs task generate only (not {spec.task})")
    if spec.model.adapters:
        problems.append("engine.backend openai: model.adapters are the endpoint's to serve (name the adapter as "
                        "engine.endpoint.model)")
    if cost.max_usd is not None and cost.usd_per_m_input is None and cost.usd_per_m_output is None:
        problems.append("cost.max_usd needs a token price: cost.usd_per_m_input and / or cost.usd_per_m_output")
    return problems
