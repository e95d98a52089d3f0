"""`engine.backend: openai`: an OpenAI-compatible endpoint (a team's vLLM or SGLang server, a hosted API) as a
worker engine, under a concurrency limit, requests- and tokens-per-minute budgets, retries and a spending cap."""
