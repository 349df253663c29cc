"""OpenAI-compatible HTTP API over a ``RequestQueue`` (FastAPI + uvicorn).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` = server-sent
events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``.

Every bad request gets a 4xx with an OpenAI-style body ``{"error": {"message", "type", "param",
"code"}}``: 400 for invalid JSON, missing or ill-typed fields, out-of-range values and an
unknown model; 413 for a body over the limit; 429 when the queue is full.  ``usage`` carries
``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and the speculative stats
(``passes``, ``tokens_per_pass``, ``accept_hist``, ``tok_s``, ``drafter``).

A generation that fails gives a 500 (``server_error``), or in a stream an event ``{"error": {...}}``
then ``data: [DONE]``.  On shutdown open requests get ``GRACE_S`` seconds to finish; then their
generations are cancelled and each ends properly: a stream with an ``error`` event and
``data: [DONE]``, a non-streaming request with a 503.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdraft.errors import SpecdraftError
from specdraft.generate import MAX_TOP_LOGPROBS, GenerationResult, TokenLogprob
from specdraft.engine import Cancelled
from specdraft.server.queue import Job, RequestQueue

log = logging.getLogger("specdraft.server")


def _version() -> str:
    try:
        return version("specdraft")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0"


__version__ = _version()


MAX_BODY_BYTES = 4 << 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
BODY_TIMEOUT_S = 30.0  # a request body must arrive within this long (then 408 and the connection closes)
GRACE_S = 5  # on shutdown, open requests get this long to finish before their generations are cancelled
STOP_S = 2  # then this long to end their responses (error event and [DONE]; 503) before uvicorn cuts them


# ---------------------------------------------------------------------- request schemas
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_turn(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)  # one choice per request

    def unsupported(self) -> None:
        """A 400 naming the first field this server does not implement, unless its value asks for nothing
        (a client must never believe a constraint or a penalty was applied)."""
        given = {**{k: getattr(self, k) for k in type(self).model_fields}, **(self.model_extra or {})}
        for name, no_op in _NO_OP.items():
            if name in given and not no_op(given[name]):
                raise _BadRequest(f"{name}: not supported by this server (it generates plain text with the "
                                  "target's own distribution); leave the field out", name, code="unsupported_field")

    def top_logprobs_wanted(self) -> int | None:
        return None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise _BadRequest("stop: at most 4 stop sequences", "stop")
        if any(not s for s in stops):
            raise _BadRequest("stop: stop sequences must be non-empty strings", "stop")
        return stops

    def limit(self) -> int | None:
        return self.max_tokens


_NO_OP = {  # fields not implemented -> the values that ask for nothing (accepted)
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "response_format": lambda v: v is None or v == {"type": "text"},
    "logit_bias": lambda v: v is None or v == {},
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "repetition_penalty": lambda v: v is None or v == 1,
    "min_p": lambda v: v is None or v == 0,
    "best_of": lambda v: v is None or v == 1,
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None or v == "",
}


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise _BadRequest("top_logprobs: needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_ids(self, queue: RequestQueue) -> list[int]:
        turns = [m.as_template_turn() for m in self.messages]
        if any(t["role"] == "user" and not t["content"].strip() for t in turns):
            raise _BadRequest("messages: a user message is empty (as `specdraft generate` refuses an empty prompt)",
                              "messages")
        queue.check_text(sum(len((t["content"] or "").encode()) for t in turns))
        return queue.target.encode_messages(turns)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # N: each token's and the N most likely

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_ids(self, queue: RequestQueue) -> list[int]:
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            vocab = queue.target.config.vocab_size
            if any(not 0 <= x < vocab for x in p):
                raise _BadRequest(f"prompt: token ids must be in [0, {vocab})", "prompt")
            return list(p)
        if isinstance(p, list):
            if len(p) != 1:
                raise _BadRequest("prompt: exactly one prompt per request (got a list of "
                                  f"{len(p)})", "prompt")
            p = p[0]
        queue.check_text(len(p.encode()))
        return queue.target.encode_prompt(p, raw=True)


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _describe(e: ValidationError) -> tuple[str, str | None]:
    """One line for a pydantic error: 'loc: message' for the first few problems."""
    errs = e.errors(include_url=False)
    parts, first = [], None
    for err in errs[:3]:
        loc = ".".join(str(x) for x in err["loc"])
        first = first or (str(err["loc"][0]) if err["loc"] else None)
        if err["type"] == "json_invalid":
            parts.append(f"the body is not valid JSON ({err['msg']})")
        elif err["type"] == "model_type" and not err["loc"]:
            parts.append("the body must be a JSON object")
        else:
            parts.append(f"{loc or 'body'}: {err['msg']}")
    more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more, first


# ---------------------------------------------------------------------- responses
def _usage(queue: RequestQueue, prompt_len: int, r: GenerationResult) -> dict:
    st = r.stats
    return {"prompt_tokens": prompt_len, "completion_tokens": st.new_tokens,
            "total_tokens": prompt_len + st.new_tokens, "passes": st.passes,
            "tokens_per_pass": round(st.tokens_per_pass, 4),
            "accept_hist": {str(k): v for k, v in st.accept_hist.items()},
            "tok_s": round(st.tok_s, 2), "wall_s": round(st.wall_s, 4), "drafter": queue.drafter.name}


class _Kind:
    """What differs between chat and text completions."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.prefix = "chatcmpl" if chat else "cmpl"
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def choice(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        if self.chat:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def delta(self, text: str | None, finish: str | None, first: bool = False, logprobs: dict | None = None) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            return {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, queue: RequestQueue, entries: list[TokenLogprob], offset: int = 0) -> dict:
        """OpenAI's logprobs object for ``entries``: chat ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
        completions ``{tokens, token_logprobs, top_logprobs, text_offset}`` (``offset``: characters before)."""
        target = queue.target

        def piece(token: int) -> tuple[str, bytes]:
            b = target.token_bytes(token)
            return b.decode("utf-8", errors="replace"), b

        if self.chat:
            def item(token: int, lp: float) -> dict:
                text, b = piece(token)
                return {"token": text, "logprob": lp, "bytes": list(b)}

            return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                                for e in entries], "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            offsets.append(offset)
            tokens.append(piece(e.token)[0])
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{piece(t)[0]: v for t, v in e.top} for e in entries], "text_offset": offsets}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


# ---------------------------------------------------------------------- the app
class _ApiKey:
    """ASGI middleware: every HTTP route but ``/health`` wants ``Authorization: Bearer <key>`` (compared in
    constant time), else 401.  Plain ASGI, so a route still sees its client disconnect."""

    def __init__(self, app, key: bytes) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                response = _error(401, "a valid API key is required (Authorization: Bearer KEY)",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(queue: RequestQueue, max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None,
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The HTTP app over ``queue``.  With ``api_key``, every route but ``/health`` wants
    ``Authorization: Bearer <api_key>`` (compared in constant time) and answers 401 otherwise."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        queue.shutdown()

    app = FastAPI(title="specdraft", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key.encode())
    app.state.queue = queue
    created = int(time.time())
    fingerprint = f"specdraft-{__version__}-{queue.drafter.name}"

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(400, f"invalid request: {exc.errors()[:3]}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error")
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": queue.model_id, "drafter": queue.drafter.name,
                "context": queue.context, "queue": queue.load(), "batch": queue.health()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(queue.metrics.text(queue.load()), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": queue.model_id, "object": "model", "created": created, "owned_by": "specdraft",
                "drafter": queue.drafter.name, "context_length": queue.context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != queue.model_id:
            return _error(404, f"model {model_id!r} not found (this server has {queue.model_id!r})",
                          param="model", code="model_not_found")
        return model_card()

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > max_body_bytes:
            raise _BadRequest(f"the body is over {max_body_bytes} bytes", status=413)
        body = bytearray()
        chunks = request.stream().__aiter__()
        deadline = time.monotonic() + body_timeout_s
        while True:  # a client that stops sending (a short body, a chunked body without its framing) is cut off
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), max(deadline - time.monotonic(), 0.001))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise _BadRequest(f"the request body did not arrive within {body_timeout_s:g} s", status=408,
                                  code="request_timeout") from None
            body += chunk
            if len(body) > max_body_bytes:
                raise _BadRequest(f"the body is over {max_body_bytes} bytes", status=413)
        return bytes(body)

    def parse(body: bytes, schema: type[_Common]):
        """Validation, the chat template and tokenizing: run on a worker thread, never on the event loop
        (a large prompt must not hold up /health or the streams)."""
        req = schema.model_validate_json(body)
        if req.model != queue.model_id:
            raise _BadRequest(f"model {req.model!r} not found (this server has {queue.model_id!r}; "
                              "see GET /v1/models)", "model", code="model_not_found")
        limit = req.limit()
        if limit is not None and limit > queue.context:
            raise _BadRequest(f"max_tokens must be <= the model's context of {queue.context} "
                              f"(got {limit})", "max_tokens")
        stops = req.stops()
        req.unsupported()
        top = req.top_logprobs_wanted()
        ids = req.prompt_ids(queue)
        queue.check_prompt(ids)
        return req, ids, queue.config(limit, req.temperature, req.top_p, req.top_k, req.seed, stops, logprobs=top)

    async def handle(request: Request, schema: type[_Common], kind: _Kind):
        try:
            req, ids, cfg = await asyncio.to_thread(parse, await read_body(request), schema)
        except ValidationError as e:
            msg, param = _describe(e)
            return _error(400, msg, param=param)
        except _BadRequest as e:  # a body that never arrived: the connection is closed, not kept alive
            return _error(e.status, e.message, e.type, e.param, e.code,
                          headers={"Connection": "close"} if e.status == 408 else None)
        except SpecdraftError as e:
            return _error(400, str(e))
        except ClientDisconnect:  # the client left while its body was being read: nothing to answer
            log.info("client disconnected before its request body was read")
            return _error(499, "client closed the request")
        rid = f"{kind.prefix}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "created": int(time.time()), "model": queue.model_id, "system_fingerprint": fingerprint}
        if req.stream:
            return await stream(queue, ids, cfg, kind, head, bool(req.stream_options and req.stream_options.include_usage))
        job = queue.submit(ids, cfg)
        if job is None:
            return busy() if not queue.closed else closing()
        return await wait(request, queue, job, kind, head)

    def closing() -> JSONResponse:
        return _error(503, "the server is shutting down", "server_error", code="shutting_down")

    def busy() -> JSONResponse:
        return _error(429, f"the server is busy: {queue.capacity} requests are running or queued; retry later",
                      "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    async def wait(request: Request, queue: RequestQueue, job: Job, kind: _Kind, head: dict):
        fut = asyncio.wrap_future(job.future)
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.25)
            if done:
                break
            if await request.is_disconnected():
                job.cancel.set()
                # nobody awaits its end now: take its outcome when it comes ("Future exception was never retrieved")
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                return _error(499, "client closed the request")
        try:
            r = fut.result()
        except Cancelled:
            return _error(503, "the generation was cancelled (server shutting down)", "server_error")
        except SpecdraftError as e:
            return _error(400, str(e))
        lp = None if r.logprobs is None else kind.logprobs(queue, r.logprobs)
        return {**head, "object": kind.object, "choices": [kind.choice(r.text, r.finish_reason, lp)],
                "usage": _usage(queue, len(job.prompt_ids), r)}

    async def stream(queue: RequestQueue, ids: list[int], cfg, kind: _Kind, head: dict, include_usage: bool):
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, item)
            except RuntimeError:  # the event loop is gone: stop generating
                if job is not None:
                    job.cancel.set()

        job = None
        want_logprobs = cfg.logprobs is not None  # then each text chunk carries its tokens' log-probabilities
        job = queue.submit(ids, cfg, on_text=lambda s: put(s),
                           on_logprobs=(lambda es: put(es)) if want_logprobs else None)
        if job is None:
            return busy() if not queue.closed else closing()
        job.future.add_done_callback(lambda f: put(None))

        async def events():
            try:
                chunk = {**head, "object": kind.chunk_object}
                if kind.chat:
                    yield _sse({**chunk, "choices": [kind.delta(None, None, first=True)]})
                pending: list[TokenLogprob] = []  # log-probabilities not sent yet (they come before their text)
                offset = 0  # characters of the completion sent so far (text_offset)
                while (s := await pieces.get()) is not None:
                    if isinstance(s, list):
                        pending += s
                        continue
                    lp = kind.logprobs(queue, pending, offset) if want_logprobs else None
                    pending, offset = [], offset + len(s)
                    yield _sse({**chunk, "choices": [kind.delta(s, None, logprobs=lp)]})
                try:
                    r = job.future.result()
                except Exception as e:  # report it in the stream, do not crash the connection
                    if isinstance(e, Cancelled):  # only a shutdown cancels a generation whose client is still here
                        msg = "the generation was cancelled (server shutting down)"
                    else:
                        msg = str(e) if isinstance(e, SpecdraftError) else f"generation stopped: {type(e).__name__}"
                    if not isinstance(e, (Cancelled, SpecdraftError)):
                        log.error("generation failed", exc_info=e)
                    yield _sse({"error": {"message": msg, "type": "server_error", "param": None, "code": None}})
                    yield _sse("[DONE]")
                    return
                lp = kind.logprobs(queue, pending, offset) if want_logprobs and pending else None
                yield _sse({**chunk, "choices": [kind.delta(None, r.finish_reason, logprobs=lp)]})
                if include_usage:
                    yield _sse({**chunk, "choices": [], "usage": _usage(queue, len(ids), r)})
                yield _sse("[DONE]")
            finally:
                job.cancel.set()  # a client that left stops its generation (no-op once finished)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    chat_kind, text_kind = _Kind(chat=True), _Kind(chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, ChatRequest, chat_kind)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, CompletionRequest, text_kind)

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, except at shutdown: once the open requests have had ``grace_s`` seconds, their
    generations are cancelled (``queue.shutdown()``) so that each response ends properly (a stream
    with an ``error`` event and ``[DONE]``, a waiting request with a 503); only what is still open
    ``STOP_S`` later is cut by uvicorn (which then shuts the queue down again from the lifespan)."""

    def __init__(self, config: uvicorn.Config, queue: RequestQueue, grace_s: float, stop_s: float = STOP_S) -> None:
        config.timeout_graceful_shutdown = grace_s + stop_s
        super().__init__(config)
        self.queue, self.grace_s = queue, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_s, self.queue.shutdown)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            self.queue.shutdown()  # also after a forced exit (a second Ctrl-C skips the lifespan's shutdown)


class ServerThread:
    """Runs ``app`` with uvicorn on a daemon thread (tests, load checks); port 0 = any free port;
    ``grace_s``: how long open requests get at shutdown before their generations are cancelled;
    ``stop_s``: how long they then get to end their responses before uvicorn cuts them.

    with ServerThread(create_app(queue)) as srv:
        OpenAI(base_url=srv.url + "/v1", api_key="none")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, quiet: bool = True,
                 grace_s: float = GRACE_S, stop_s: float = STOP_S) -> None:
        self.host = host
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning" if quiet else "info", access_log=not quiet)
        self.server = _Server(config, app.state.queue, grace_s, stop_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="specdraft-server")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.server.queue.start()  # the queue's loop on a thread of its own
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.server.should_exit = True
                self.server.queue.shutdown()
                self.sock.close()
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def serve(queue: RequestQueue, host: str = "127.0.0.1", port: int = 8000, quiet: bool = False,
          api_key: str | None = None) -> None:
    """Run the server until Ctrl-C (or SIGTERM): HTTP on a thread, the queue's loop (all the model's work) on
    this one, the thread that loaded the model (``server.queue``'s docstring says why).  The first signal
    starts the graceful shutdown (``_Server``), a second one cuts it short."""
    config = uvicorn.Config(create_app(queue, api_key=api_key), host=host, port=port, log_level="warning" if quiet else "info",
                            access_log=not quiet)
    server = _Server(config, queue, GRACE_S)
    http = threading.Thread(target=server.run, name="specdraft-http", daemon=True)

    def on_signal(signum, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    try:
        queue.run(stop=lambda: not http.is_alive())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.should_exit = True  # also when the loop itself failed
        queue.shutdown()
        http.join(timeout=GRACE_S + STOP_S + 5)
    if not server.started:  # uvicorn has logged why (the port is taken, ...)
        raise SpecdraftError(f"the server did not start on {host}:{port}")
