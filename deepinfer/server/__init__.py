"""OpenAI-compatible HTTP server over `LLMEngine` (FastAPI + uvicorn).

`build_app(ServerConfig)` gives the ASGI app; `serve(ServerConfig)` runs it under uvicorn (what
`deepinfer serve` calls). Exports are lazy so `deepinfer --help` does not pay for importing FastAPI.
"""
from __future__ import annotations

__all__ = ["ServerConfig", "build_app", "serve"]


def __getattr__(name: str):
    if name in __all__:
        from deepinfer.server import app

        return getattr(app, name)
    raise AttributeError(name)
