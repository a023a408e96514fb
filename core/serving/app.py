"""The OpenAI-compatible HTTP app: ``create_app(aengine, model_name, api_key=None,
tool_call_parser=None)``.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` as server-sent events), ``GET /health``, ``GET /metrics`` (Prometheus)
and ``GET /`` (the chat page, ``static/``). Every error is OpenAI's JSON shape with the
parameter at fault: 400 bad input, 401 wrong or missing key (``/v1`` only), 404 unknown
model, 413 a body over ``max_request_bytes``, 503 queue full. A request's body is decoded,
parsed and tokenised on a pool thread (``prompts.py``), so that the event loop serves on
while a long prompt is tokenised. Chat requests with tools have the model's text read back
as ``tool_calls`` by the tool-call family ``tool_call_parser`` names (by default the one
the chat template asks for: ``tool_calls/``). The app's lifespan starts the AsyncEngine
and, when the server stops, shuts it down letting running requests finish."""
from __future__ import annotations

import asyncio
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import lru_cache, partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from ..errors import InvalidRequestError
from ..request import SamplingParams
from . import responses as R
from .async_engine import QueueFullError
from .body import DEFAULT_MAX_REQUEST_BYTES, decode_json, read_body
from .fanout import Fanout
from .metrics import ServerMetrics
from .prompts import PromptEncoder, too_long
from .protocol import OpenAIError, ParsedRequest, bad, param_of, parse_chat, parse_completion
from .tool_calls import FAMILIES, detect, special_marker_id, template_of

STATIC = Path(__file__).parent / "static"
SHUTDOWN_TIMEOUT = 30.0  # seconds running requests get to finish when the server stops
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Threads that decode, parse and tokenise requests: a few, so that one long prompt does
# not hold up the short ones behind it
PROMPT_THREADS = 4


def create_app(aengine, model_name: str, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tool_call_parser: str | None = None) -> FastAPI:
    engine = aengine.engine
    metrics = ServerMetrics(aengine)
    started = int(time.time())
    tools = tool_family(engine.tokenizer, tool_call_parser)
    marker_id = special_marker_id(engine.tokenizer, tools)
    prompts = PromptEncoder(engine, tools)
    parse_chat_here = partial(parse_chat, arguments_key=tools.arguments_key)
    pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="infergraft-prompts")

    @asynccontextmanager
    async def lifespan(app):
        await aengine.start()
        try:
            yield
        finally:
            await aengine.shutdown(drain=True, timeout=SHUTDOWN_TIMEOUT)
            pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    app = FastAPI(title="infergraft", lifespan=lifespan)
    app.state.metrics, app.state.tool_family = metrics, tools
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @lru_cache(maxsize=1 << 16)
    def token_text(token_id: int) -> str:
        return engine.tokenizer.decode([token_id])

    def reply_error(e: OpenAIError) -> JSONResponse:
        metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request, e: OpenAIError):
        return reply_error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return reply_error(OpenAIError(e.status_code, f"{e.detail}: {request.method} "
                                       f"{request.url.path}", code=str(e.status_code)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        return reply_error(bad(None, f"the request is malformed: {e.errors()}"))

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise OpenAIError(401, "no API key given: this server needs `Authorization: "
                              "Bearer KEY` with its --api-key (or INFERGRAFT_API_KEY)",
                              code="invalid_api_key")
        if not secrets.compare_digest(key.strip().encode(), api_key.encode()):
            raise OpenAIError(401, "incorrect API key: send the server's --api-key (or "
                              "INFERGRAFT_API_KEY) as `Authorization: Bearer KEY`",
                              code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise OpenAIError(404, f"the model `{name}` does not exist: this server serves "
                              f"`{model_name}` (GET /v1/models)", param="model",
                              code="model_not_found")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": started,
                "owned_by": "infergraft", "max_model_len": engine.plan.max_seq_len}

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request):
        authorize(request)
        check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        return await serve(request, await parsed(request, parse_completion))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        return await serve(request, await parsed(request, parse_chat_here))

    async def parsed(request: Request, parse) -> ParsedRequest:
        raw = await read_body(request, max_request_bytes)
        return await off_loop(lambda: parse(decode_json(raw)))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        # stats() waits for the step in progress: off the event loop, streams go on
        content, kind = await asyncio.to_thread(metrics.render)
        return Response(content, media_type=kind)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    def jobs_of(req: ParsedRequest, rid: str, batch: list[list[int]]) -> list:
        limit = engine.plan.max_seq_len
        what = "prompt" if req.kind == "completion" else "messages"
        jobs = []
        for p, ids in enumerate(batch):
            if len(ids) >= limit:
                raise too_long(what, f"{len(ids)} tokens", limit)
            kw = dict(req.sampling)
            kw["max_new_tokens"] = kw["max_new_tokens"] or limit - len(ids)
            if len(ids) + kw["max_new_tokens"] > limit:
                raise bad(req.max_tokens_name, f"{what} of {len(ids)} tokens + "
                          f"{req.max_tokens_name}={kw['max_new_tokens']} exceeds the context "
                          f"of max_seq_len={limit} tokens: ask for at most "
                          f"{limit - len(ids)}", code="context_length_exceeded")
            kw["logprobs"] = req.logprobs
            for j in range(req.n):
                seed = None if kw["seed"] is None else kw["seed"] + j  # choice j: seed + j
                jobs.append((ids, SamplingParams(**dict(kw, seed=seed)),
                             f"{rid}-{p * req.n + j}"))
        return jobs

    async def serve(request: Request, req: ParsedRequest):
        check_model(req.model)
        rid = R.request_id(req.kind)
        try:
            batch = await off_loop(prompts.encode, req)
            fan = Fanout(aengine, jobs_of(req, rid, batch))
            await fan.start()
        except InvalidRequestError as e:  # the engine's own checks: name the parameter
            param = param_of(str(e), req.kind)
            message = str(e) if param is None or str(e).startswith(param) else f"{param}: {e}"
            raise bad(param, message) from e
        except QueueFullError as e:
            raise OpenAIError(503, f"{e}; retry later", type="server_error",
                              code="queue_full") from e
        prompt_tokens = sum(map(len, batch))
        choices = [R.Choice(i) for i in range(len(fan.jobs))]
        shape = shaper_of(req)
        if req.stream:
            return StreamingResponse(events(req, rid, fan, choices, prompt_tokens, shape),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await collect(request, req, rid, fan, choices, prompt_tokens, shape)

    def shaper_of(req: ParsedRequest):
        """Makes a choice's tool-call shaper (None: no tools, or tool_choice none)."""
        if req.tools is None or req.tools.choice == "none":
            return None
        decode = partial(engine.tokenizer.decode, skip_special_tokens=True)
        return lambda: req.tools.shaper(tools, marker_id, decode)

    def take(choices, index: int, out) -> None:
        choices[index].add(out)
        if out.finished:
            metrics.finished(out.finish_reason, out.metrics)

    def failure(choices) -> str | None:
        failed = [c for c in choices if c.finish_reason == "error"]
        return None if not failed else (failed[0].error or "sampling failed")

    async def events(req, rid, fan: Fanout, choices, prompt_tokens: int, shape):
        writer = R.ChunkWriter(req.kind, rid, model_name, len(choices), req.include_usage,
                               token_text, token_ids=engine.tokenizer is None, shape=shape)
        try:
            async for index, out in fan.outputs():
                take(choices, index, out)
                if out.finished and out.finish_reason == "error":
                    yield R.error_event(f"choice {index} failed: {failure(choices)}")
                    break
                event = writer.output(index, out)
                if event:
                    yield event
            else:
                yield writer.usage(R.request_usage(prompt_tokens, choices, req.n))
        except Exception as e:  # noqa: BLE001 -- the status is sent: say it in the stream
            yield R.error_event(f"the engine failed: {type(e).__name__}: {e}")
        finally:
            # the client left (Starlette cancels this generator), or an error ended it
            fan.close()
            for c in choices:
                if c.finish_reason is None:
                    metrics.finished("abort")
        yield R.DONE

    async def collect(request, req, rid, fan: Fanout, choices, prompt_tokens: int, shape):
        async def run():
            async for index, out in fan.outputs():
                take(choices, index, out)

        work, gone = asyncio.create_task(run()), asyncio.create_task(client_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client left: free its requests now
                work.cancel()
                fan.close()
                for c in choices:
                    if c.finish_reason is None:
                        metrics.finished("abort")
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody reads it (nginx's "client closed")
        if work.exception() is not None:
            raise OpenAIError(500, f"the engine failed: {work.exception()}", type="server_error")
        why = failure(choices)
        if why is not None:
            raise OpenAIError(500, f"the request failed: {why}", type="server_error")
        use = R.request_usage(prompt_tokens, choices, req.n)
        return R.body(req.kind, rid, R.now(), model_name, choices, use, token_text, shape)

    return app


def tool_family(tokenizer, name: str | None):
    """The tool-call family ``name`` gives (``--tool-call-parser``), else the one the chat
    template asks for."""
    if name is None:
        name = detect(template_of(tokenizer))
    if name not in FAMILIES:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
