"""The OpenAI-compatible HTTP server: a FastAPI app over one `AsyncLLM`.

    app = build_app(async_llm, "tiny", api_key=None, max_queued_requests=1024)
    uvicorn.run(app, host="127.0.0.1", port=8000)        (jaxserve/launch/serve.py does this)

Endpoints: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions,
POST /v1/responses (text: serving_responses.py), GET /health, GET /metrics (Prometheus text),
GET /version (vLLM's), POST /tokenize, POST /detokenize; with runtime LoRA updates allowed,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's).

LoRA (EngineConfig.enable_lora): the adapters given at start (`lora_modules`, name -> PEFT folder)
and those loaded at run time are served by name: a request's `model` selects one (the base model
by its own name), and /v1/models lists each with its `root` folder and `parent` model.

Each generation request: auth (Bearer api_key; /health, /metrics and /version stay open) -> body
size -> queue check (503 + Retry-After once max_queued_requests wait for a slot) -> strict parsing
(400 naming the field) -> serving_completion / serving_chat. A non-streaming handler races the client:
if the connection drops first, the handler is cancelled, which aborts its engine requests. A
streaming response aborts them when it ends for any reason (client gone included).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import itertools

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxserve.entrypoints.metrics import ServerMetrics
from jaxserve.entrypoints.openai.protocol.chat import ChatCompletionRequest
from jaxserve.entrypoints.openai.protocol.completion import CompletionRequest
from jaxserve.entrypoints.openai.protocol.models import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from jaxserve.entrypoints.openai.protocol.responses import ResponsesRequest
from jaxserve.entrypoints.openai.protocol.tokenization import DetokenizeRequest, TokenizeRequest
from jaxserve.entrypoints.openai.serving import APIError, ServingState, off_loop, tokenize_text
from jaxserve.entrypoints.openai.serving_chat import apply_template, create_chat_completion
from jaxserve.entrypoints.openai.serving_completion import create_completion
from jaxserve.entrypoints.openai.serving_responses import create_response
from jaxserve.lora import LoRARequest
from jaxserve.lora.peft import read_adapter

MAX_BODY_BYTES = 8 * 2**20
_OPEN_PATHS = ("/health", "/metrics", "/version")


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _parse(model: type[pydantic.BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"invalid JSON body: {err['msg']}") from None
        loc = ".".join(str(x) for x in err["loc"])
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(400, f"{loc}: {err['msg']}", param) from None


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, coro):
    """Runs `coro`; returns None (and cancels it) if the client disconnects first."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


class _AbortingStream(StreamingResponse):
    """An SSE response whose body iterator is closed (so its engine requests abort) however the
    response ends: finished, failed, or cut off by the client."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Guard:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects): the
    Bearer api_key (/health, /metrics and /version stay open) and the declared body size."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = None
        if self.api_key is not None and scope["path"] not in _OPEN_PATHS:
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                error = APIError(
                    401, "invalid or missing API key", type="authentication_error",
                    code="invalid_api_key",
                )  # fmt: skip
        length = headers.get("content-length", "")
        if error is None and length.isdigit() and int(length) > self.max_body_bytes:
            error = APIError(413, f"request body over {self.max_body_bytes} bytes")
        if error is not None:
            return await _error(error)(scope, receive, send)
        return await self.app(scope, receive, send)


def engine_requests(req) -> tuple[int, str]:
    """(engine requests `req` queues: its prompts x n, the field that sets the count). A
    completion's prompt may be a list of prompts (strs, or token-id lists); a list of ints is one
    prompt's token ids."""
    n = getattr(req, "n", None) or 1
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt) * n, "prompt"
    return n, "n"


def build_app(
    async_llm,
    served_model_name: str,
    api_key: str | None = None,
    max_queued_requests: int = 1024,
    request_timeout_s: float | None = None,
    chat_template: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    trust_request_chat_template: bool = False,
    lora_modules: dict[str, str] | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The app. `max_queued_requests`: requests allowed to wait for a slot before 503.
    lora_modules: LoRA adapters served by name (name -> PEFT folder; needs enable_lora), each
    read and checked now (ValueError naming a bad one); allow_runtime_lora_updating: the load /
    unload endpoints (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(async_llm, served_model_name)
    state = ServingState(
        async_llm,
        served_model_name,
        metrics,
        request_timeout_s=request_timeout_s,
        chat_template=chat_template,
        max_n=async_llm.engine_config.num_slots,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        trust_request_chat_template=trust_request_chat_template,
    )
    app.state.serving = state
    lora_ids = itertools.count(1)  # an id is never reused, even after an unload

    def lora_request(name: str, path: str) -> LoRARequest:
        """A checked adapter for this model (ValueError naming what is wrong)."""
        if not async_llm.engine_config.enable_lora:
            raise ValueError(f"LoRA adapter {name!r}: the engine was started without enable_lora")
        if name == served_model_name:
            raise ValueError(f"LoRA adapter {name!r}: the name is the base model's")
        req = LoRARequest(name, next(lora_ids), path)
        read_adapter(req, async_llm.model_config, async_llm.engine_config.max_lora_rank)
        return req

    for name, path in (lora_modules or {}).items():
        state.loras[name] = lora_request(name, path)

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):
        # an unknown path or a wrong method: OpenAI's error object, as every other error
        what = "Invalid URL" if e.status_code == 404 else e.detail
        message = f"{what} ({request.method} {request.url.path})"
        return _error(APIError(e.status_code, message, headers=e.headers))

    async def body_of(request: Request) -> bytes:
        body = await request.body()
        if len(body) > max_body_bytes:
            raise APIError(413, f"request body over {max_body_bytes} bytes")
        return body

    def check_capacity() -> None:
        if not async_llm.is_running:
            raise APIError(503, "the engine is not running", type="service_unavailable")
        if async_llm.num_waiting >= max_queued_requests:
            raise APIError(
                503,
                f"server busy: {max_queued_requests} requests already waiting; retry later",
                type="service_unavailable",
                headers={"Retry-After": "1"},
            )

    async def serve(request: Request, model, handler):
        check_capacity()
        req = _parse(model, await body_of(request))
        # A request queues one engine request per prompt and sample: count them all against
        # the limit, so one client's 20,000-prompt list cannot fill the engine.
        cost, field = engine_requests(req)
        if cost > max_queued_requests:
            raise APIError(
                400,
                f"this request asks for {cost} completions (prompts x n), more than the "
                f"server queues at once (max_queued_requests={max_queued_requests}); split it",
                field,
            )
        if async_llm.num_waiting + cost > max_queued_requests:
            raise APIError(
                503,
                f"server busy: {async_llm.num_waiting} requests already waiting and this one "
                f"adds {cost} (max_queued_requests={max_queued_requests}); retry later",
                type="service_unavailable",
                headers={"Retry-After": "1"},
            )
        if req.stream:
            events = await handler(state, req)
            return _AbortingStream(events, media_type="text/event-stream")

        async def run():
            try:
                return (await handler(state, req)).model_dump()
            except APIError as e:
                return e

        result = await _until_disconnect(request, run())
        if result is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        if isinstance(result, APIError):
            return _error(result)
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, CompletionRequest, create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, ChatCompletionRequest, create_chat_completion)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await serve(request, ResponsesRequest, create_response)

    def model_card(name: str | None = None) -> ModelCard:
        lora = state.check_model(name)
        if lora is None:
            return ModelCard(id=served_model_name, max_model_len=state.max_model_len)
        return ModelCard(
            id=lora.lora_name,
            max_model_len=state.max_model_len,
            root=lora.lora_path,
            parent=served_model_name,
        )

    @app.get("/v1/models")
    async def models():
        cards = [model_card()] + [model_card(name) for name in state.loras]
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model(model: str):  # the openai client's models.retrieve(id)
        return model_card(model).model_dump()

    if allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            req = _parse(LoadLoRAAdapterRequest, await body_of(request))
            if req.lora_name in state.loras and not req.load_inplace:
                raise APIError(
                    400,
                    f"The lora adapter '{req.lora_name}' has already been loaded.",
                    "lora_name",
                )
            try:  # reading the adapter's files must not stall other clients
                lora = await off_loop(lora_request, req.lora_name, req.lora_path)
            except ValueError as e:
                raise APIError(400, str(e), "lora_path") from None
            state.loras[req.lora_name] = lora
            return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            req = _parse(UnloadLoRAAdapterRequest, await body_of(request))
            lora = state.loras.get(req.lora_name)
            if lora is None or req.lora_int_id not in (None, lora.lora_int_id):
                raise APIError(
                    404,
                    f"The lora adapter '{req.lora_name}' cannot be found.",
                    "lora_name",
                    type="not_found_error",
                )
            del state.loras[req.lora_name]  # running requests finish; its slot is evicted later
            return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.get("/health")
    async def health():
        return Response(status_code=200 if async_llm.is_running else 503)

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("jaxserve")}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = _parse(TokenizeRequest, await body_of(request))
        state.check_model(req.model)
        if req.messages is not None:
            _, ids = await off_loop(apply_template, state, req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await off_loop(tokenize_text, state, req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "tokenize needs 'prompt' or 'messages'", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = _parse(DetokenizeRequest, await body_of(request))
        state.check_model(req.model)
        if state.tokenizer is None:
            raise APIError(400, "detokenize needs a tokenizer; this model has none", "tokens")
        if not all(0 <= t < state.vocab_size for t in req.tokens):
            raise APIError(400, f"tokens must be in [0, {state.vocab_size})", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    return app
