"""The FastAPI app: configuration, auth, error handlers, lifespan (engine loop start / clean shutdown), and
the small routes (/health, /metrics, /v1/models, /tokenize, /detokenize). `serve()` runs it in uvicorn.

Auth (--api-key) guards /v1/* and /tokenize, /detokenize as vLLM does; /health and /metrics stay open for
probes and scrapers. Every error leaves in OpenAI's schema; only a real server bug can be a 500.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.server.async_engine import AsyncEngine
from deepinfer.server.errors import APIError, bad_request
from deepinfer.server.metrics import Metrics
from deepinfer.server.openai_routes import router as openai_router

log = logging.getLogger("deepinfer.server")


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # None: the embedded tiny default
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    numerics: str = "exact"
    seed: int = 0
    max_waiting: int = 256  # requests not yet scheduled; more get 429
    max_request_bytes: int = 4 << 20  # larger bodies get 413
    shutdown_grace_s: float = 5.0  # SIGTERM: in-flight requests get this long to finish, then are aborted
    speculative_method: str | None = None  # "mtp" | "dspark": draft and verify (spec/)
    num_speculative_tokens: int = 1
    tensor_parallel_size: int = 1  # parallel ranks: engine/distributed_runner.py
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    async_scheduling: bool | None = None  # None: the engine's default (on for one CUDA process)

    def engine_config(self, model_dir: str) -> EngineConfig:
        return EngineConfig(model=model_dir, numerics=self.numerics, max_model_len=self.max_model_len,
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            num_blocks=self.num_blocks, kv_cache_bytes=self.kv_cache_bytes, seed=self.seed,
                            tensor_parallel_size=self.tensor_parallel_size,
                            expert_parallel_size=self.expert_parallel_size,
                            data_parallel_size=self.data_parallel_size, async_scheduling=self.async_scheduling)


def build_app(config: ServerConfig, engine: LLMEngine | None = None) -> FastAPI:
    if config.model is None:
        from deepinfer.tiny import default_model_dir

        model_dir, default_name = str(default_model_dir()), "deepinfer-tiny-v4"
    else:
        model_dir, default_name = config.model, config.model
    speculative = None if config.speculative_method is None else {
        "method": config.speculative_method, "num_speculative_tokens": config.num_speculative_tokens}
    engine = engine or LLMEngine(config.engine_config(model_dir), speculative=speculative)
    metrics = Metrics()
    async_engine = AsyncEngine(engine, metrics, config.max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown(config.shutdown_grace_s)

    app = FastAPI(title="deepinfer", lifespan=lifespan)
    st = app.state
    st.config, st.engine, st.metrics = config, async_engine, metrics
    st.model_names, st.model_dir = [config.served_model_name or default_name], model_dir
    st.max_model_len = engine.config.max_model_len
    st.created = int(time.time())

    async def read_json(request: Request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > config.max_request_bytes:
            raise APIError(413, f"request body over {config.max_request_bytes} bytes", code="request_too_large")
        raw = await request.body()
        if len(raw) > config.max_request_bytes:
            raise APIError(413, f"request body over {config.max_request_bytes} bytes", code="request_too_large")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise bad_request(f"invalid JSON body: {e}") from None

    st.read_json = read_json

    async def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    _install_error_handlers(app, metrics)
    app.include_router(openai_router, dependencies=[Depends(check_auth)])

    # The endpoints reach the engine through request.app.state, never a closure: FastAPI keeps up to 4096
    # endpoint callables in a module-level cache (fastapi.dependencies.models, 0.165), so an endpoint closing over
    # the engine kept every app's model alive after its server stopped (~650 MB a ThreadedServer of the tiny model)
    @app.get("/health")
    async def health(request: Request):
        return Response(status_code=200 if request.app.state.engine.accepting else 503)

    @app.get("/metrics")
    async def prometheus(request: Request):
        return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models(request: Request):
        s = request.app.state
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": s.created, "owned_by": "deepinfer", "root": s.model_dir,
             "max_model_len": s.max_model_len} for name in s.model_names]}

    @app.post("/tokenize", dependencies=[Depends(check_auth)])
    async def tokenize(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        tok = request.app.state.engine.engine.tokenizer
        try:
            if "messages" in body:
                kw = body.get("chat_template_kwargs") or {}
                ids = tok.apply_chat(body["messages"], thinking=bool(kw.get("thinking", False)),
                                     reasoning_effort=kw.get("reasoning_effort"))
            elif isinstance(body.get("prompt"), str):
                ids = tok.encode(body["prompt"])
            else:
                raise ValueError("give a string `prompt` or `messages`")
        except Exception as e:  # noqa: BLE001 - the input is all that can be wrong here
            raise bad_request(f"cannot tokenize: {e}") from None
        return {"count": len(ids), "max_model_len": request.app.state.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(check_auth)])
    async def detokenize(request: Request):
        body = await read_json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise bad_request("`tokens` must be a list of token ids", param="tokens")
        try:
            return {"prompt": request.app.state.engine.engine.tokenizer.decode(ids)}
        except Exception as e:  # noqa: BLE001 - out-of-range ids
            raise bad_request(f"cannot detokenize: {e}", param="tokens") from None

    return app


def _install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        metrics.http_errors.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return await api_error(request, bad_request(f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # 404 route, 405 method, ...
        return await api_error(request, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}"))


def serve(config: ServerConfig) -> None:
    """Run until SIGINT/SIGTERM. uvicorn stops accepting, waits for open responses (up to the grace period);
    the lifespan then aborts whatever is left, so every request ends and every KV block is freed."""
    import uvicorn

    app = build_app(config)
    log.info("serving %s on http://%s:%d", app.state.model_names[0], config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info",
                timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s)))
