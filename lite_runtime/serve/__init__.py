"""An OpenAI-compatible HTTP server for a model folder, with continuous batching over its static graphs.

    python -m lite_runtime.serve --model_dir model_dirs/qwen2-tiny [--host 127.0.0.1] [--port 8000]
                                 [--backend auto|mslite|ms] [--api_key KEY] [--max_queue N] [--metrics_public]

Three layers, as vLLM's entrypoints/openai: `protocol` (the request bodies as pydantic models, OpenAI's error
shape), `serving` (a request becomes engine requests, one per choice; `responses` shapes what comes back;
`tools` reads tool calls; `grammar` masks tokens for structured output) and `app` (the HTTP routes); `metrics`
(Prometheus) and `cli` (loading, the command). The engine (lite_runtime.engine.scheduler) knows no HTTP.

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client, llguidance): pip install -e ".[serve]". Nothing is
imported until used, so lite_runtime stays importable without them.
"""
from typing import Any

_EXPORTS = {"create_app": "app", "Service": "serving", "Plan": "serving", "APIError": "protocol",
            "load_service": "cli", "main": "cli", "build_parser": "cli", "is_loopback": "cli"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lite_runtime.serve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"lite_runtime.serve.{_EXPORTS[name]}"), name)
