"""The FastAPI app: OpenAI's routes on top of `AsyncLLM`.

A request's path: FastAPI parses the JSON into a `protocol` model (400 if it does not fit) -> the route turns
the prompt or the chat messages into token ids and the fields into a `SamplingParams`, and the engine checks
them (400 if it refuses) -> one `engine.generate(...)` stream per prompt; the engine core's busy loop puts the
request into its scheduler's waiting queue and, step after step, sends back the newly decoded text (DELTA
outputs) -> the route forwards each piece as a server-sent event, or gathers them into one JSON answer.
A client that goes away cancels the task that iterates its stream, which aborts the request in the engine.
Beside it: beam.py (`use_beam_search`: engine.beam_search instead), echo.py, structured.py, logprobs.py,
errors.py (every error in OpenAI's shape), metrics.py, dashboard.py.
"""
import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from time import perf_counter

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response as HTTPResponse
from fastapi.responses import StreamingResponse

from nanoserve.llm import prompt_token_ids
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import RequestOutputKind, SamplingParams
from nanoserve.serving.beam import beam_search_streams, check_beam_fields
from nanoserve.serving.dashboard import add_dashboard
from nanoserve.serving.echo import Echo, generate_nothing, make_echo
from nanoserve.serving.errors import APIKeyMiddleware, add_error_handlers
from nanoserve.serving.logprobs import LogprobsFormat
from nanoserve.serving.metrics import Metrics
from nanoserve.serving.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    DeltaMessage,
    Response,
    SamplingRequest,
    Usage,
)
from nanoserve.serving.structured import chat_tools, structured_outputs_params, with_tool_calls
from nanoserve.serving.tool_messages import conversation
from nanoserve.serving.tool_stream import ToolCallStream
from nanoserve.structured_outputs import StructuredOutputsParams

Outputs = AsyncIterator[tuple[int, RequestOutput]]  # (prompt index, delta output), in the order they come


# ---- from the request to the engine ----------------------------------------------------------------
def refuse_unsupported(request: SamplingRequest) -> None:
    check_beam_fields(request)  # beam search's fields without it, or sampling's with it
    if getattr(request, "top_logprobs", None) is not None and not request.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")


def check_length(request: SamplingRequest, prompt: list[int], max_tokens: int | None, max_model_len: int) -> None:
    """A prompt + max_tokens over max_model_len: `param` names the prompt if it leaves no room at all, else
    max_tokens (the engine's own check cannot tell which field the client should change)."""
    prompt_field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if len(prompt) >= max_model_len:
        raise APIError(400, f"{prompt_field}: {len(prompt)} tokens leave no room for an answer within "
                       f"max_model_len ({max_model_len})", prompt_field)
    if max_tokens is not None and len(prompt) + max_tokens > max_model_len:
        raise APIError(400, f"max_tokens: {max_tokens} + the prompt's {len(prompt)} tokens exceeds max_model_len "
                       f"({max_model_len}); at most {max_model_len - len(prompt)}", "max_tokens")


def sampling_params(request: SamplingRequest, max_tokens: int | None, room: int,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """room: what max_model_len leaves after the prompt, the default max_tokens (as in vLLM)."""
    return SamplingParams(n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                          min_p=request.min_p, presence_penalty=request.presence_penalty,
                          frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
                          logprobs=request.num_logprobs(), prompt_logprobs=request.num_prompt_logprobs(),
                          max_tokens=max(room, 1) if max_tokens is None else max_tokens, min_tokens=request.min_tokens,
                          ignore_eos=request.ignore_eos, stop_token_ids=request.stop_token_ids or [],
                          stop=request.stop, include_stop_str_in_output=request.include_stop_str_in_output,
                          seed=request.seed, output_kind=RequestOutputKind.DELTA,
                          structured_outputs=structured_outputs)


def as_api_error(e: ValueError, request: SamplingRequest) -> APIError:
    """The engine's messages start with the field they are about ("temperature must be ..."): that is `param`."""
    first_word = str(e).split(" ", 1)[0].rstrip(":")
    fields = type(request).model_fields
    return APIError(400, str(e), first_word if first_word in fields else None)


async def merge(streams: list[AsyncIterator[RequestOutput]], shutting_down: asyncio.Event) -> Outputs:
    """Interleave the prompts' streams as their outputs come. Closing this cancels them all, which aborts them
    in the engine; so does a server shutdown whose grace period ran out (then this raises a 503)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out, None))
            await queue.put((index, None, None))
        except Exception as e:  # handed to the reader, who re-raises it
            await queue.put((index, None, e))

    async def watch() -> None:
        await shutting_down.wait()
        await queue.put((-1, None, APIError(503, "the server is shutting down: request aborted", type="server_error")))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)] + [asyncio.create_task(watch())]
    try:
        num_running = len(streams)
        while num_running:
            index, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                num_running -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()


# ---- from the engine back to the client -------------------------------------------------------------
def make_choice(chat: bool, stream: bool, index: int, text: str, finish_reason=None, stop_reason=None,
                logprobs=None):
    kw = dict(index=index, finish_reason=finish_reason, stop_reason=stop_reason, logprobs=logprobs)
    if not chat:
        return CompletionChoice(text=text, **kw)
    if stream:
        return ChatChunkChoice(delta=DeltaMessage(content=text), **kw)
    return ChatChoice(message=DeltaMessage(role="assistant", content=text), **kw)


async def collect(outputs: Outputs, header: dict, chat: bool, n: int, logprobs: LogprobsFormat | None,
                  echo: Echo | None) -> Response:
    """The whole answer at once: the deltas of each prompt's n sequences joined, choice i * n + j."""
    texts, token_ids, lps, endings, num_tokens, usage = {}, {}, {}, {}, {}, Usage()
    async for i, out in outputs:
        c = out.outputs[0]
        num_tokens[i] = num_tokens.get(i, 0) + len(c.token_ids)
        index = i * n + c.index
        shown = echo.prepend(i, out, c) if echo and index not in texts else c
        texts[index] = texts.get(index, "") + shown.text
        token_ids.setdefault(index, []).extend(shown.token_ids)
        lps.setdefault(index, []).extend(shown.logprobs or [])
        endings[index] = (c.finish_reason, c.stop_reason)
        if out.finished:
            usage.add(len(out.prompt_token_ids), num_tokens[i], out.num_cached_tokens)
    choices = [make_choice(chat, False, j, texts[j], *endings[j], logprobs and logprobs(token_ids[j], lps[j]))
               for j in sorted(texts)]
    return Response(**header, choices=choices, usage=usage)


def event(response: Response | dict | str) -> str:
    data = response.model_dump_json() if isinstance(response, Response) else \
        response if isinstance(response, str) else json.dumps(response)
    return f"data: {data}\n\n"


async def stream_events(outputs: Outputs, header: dict, chat: bool, num_choices: int, n: int,
                        logprobs: LogprobsFormat | None, include_usage: bool, echo: Echo | None,
                        tool_calls: ToolCallStream | None = None) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta (choice i * n + j), a last one per choice with finish_reason, usage
    if asked, then [DONE]. tool_calls: turns the text into tool-call deltas (serving/tool_stream.py)."""
    num_tokens, text_lens, usage = {}, {}, Usage()
    try:
        if chat:  # OpenAI's first chunk names the role
            choices = [ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                       for j in range(num_choices)]
            yield event(Response(**header, choices=choices))
        async for i, out in outputs:
            c = out.outputs[0]
            num_tokens[i] = num_tokens.get(i, 0) + len(c.token_ids)
            index = i * n + c.index
            shown = echo.prepend(i, out, c) if echo and index not in text_lens else c  # (the first chunk)
            if shown.text or c.finish_reason or shown.logprobs:
                lps = logprobs and logprobs(shown.token_ids, shown.logprobs or [], text_lens.get(index, 0))
                choice = make_choice(chat, True, index, shown.text, c.finish_reason, c.stop_reason, lps)
                if tool_calls is None or tool_calls.rewrite(choice):
                    yield event(Response(**header, choices=[choice]))
            text_lens[index] = text_lens.get(index, 0) + len(shown.text)
            if out.finished:
                usage.add(len(out.prompt_token_ids), num_tokens[i], out.num_cached_tokens)
        if include_usage:
            yield event(Response(**header, choices=[], usage=usage))
    except Exception as e:  # the status line is sent already: report the error in the stream, as vLLM does
        error = e if isinstance(e, APIError) else APIError(500, f"{type(e).__name__}: {e}", type="server_error")
        yield event(error.body())
    yield event("[DONE]")


async def cancel_on_disconnect(work, raw: Request):
    """Run `work` (a non-streamed answer) unless the client disconnects first; then cancel it (aborting)."""
    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not task.done():
        task.cancel()
        return HTTPResponse(status_code=499)  # nobody reads it: nginx's "client closed request"
    return task.result()


# ---- the app ---------------------------------------------------------------------------------------
def build_app(engine, model_name: str, api_key: str | None = None, tool_call_parser: str | None = None,
              dashboard: bool = False) -> FastAPI:
    """engine: an `AsyncLLM`; model_name: what /v1/models lists and requests must name; tool_call_parser
    ("hermes"): answer tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser); dashboard: serve the
    live view of the engine at /dashboard (serving/dashboard.py)."""
    core, tokenizer = engine.engine_core, engine.tokenizer
    config = core.config
    metrics = Metrics(core, model_name)
    app = FastAPI(title="nanoserve", summary="An OpenAI-compatible server for the nanoserve engine")
    app.state.shutting_down = asyncio.Event()  # set when a shutdown's grace period is over: abort what runs
    app.state.stopping = asyncio.Event()  # set when a shutdown begins: endless streams (/debug/steps) end
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    v1 = APIRouter(prefix="/v1")

    def start(request: SamplingRequest, prompts: list[list[int]], max_tokens: int | None) -> Outputs:
        """Check everything, then submit one engine request per prompt: bad input is a 400 before any work."""
        arrival = perf_counter()
        if request.model not in (None, model_name):
            raise APIError(404, f"The model `{request.model}` does not exist.", "model", "model_not_found")
        refuse_unsupported(request)
        for p in prompts:
            check_length(request, p, max_tokens, config.max_model_len)
        structured = structured_outputs_params(request, tool_call_parser)  # response_format, tools, ...
        request_id = uuid.uuid4().hex
        try:
            if request.use_beam_search:  # vLLM's extension (serving/beam.py)
                streams = beam_search_streams(engine, request, prompts, max_tokens, request_id)
            else:
                params = [sampling_params(request, max_tokens, config.max_model_len - len(p), structured)
                          for p in prompts]
                for ids, sp in zip(prompts, params):
                    core.check_request(ids, sp, request.priority)
                streams = [engine.generate(ids, sp, request_id=f"{request_id}-{i}", priority=request.priority)
                           for i, (ids, sp) in enumerate(zip(prompts, params))]
        except ValueError as e:
            raise as_api_error(e, request) from e
        return merge([metrics.observe(stream, arrival) for stream in streams], app.state.shutting_down)

    async def answer(request: SamplingRequest, raw: Request, prompts: list[list[int]], max_tokens: int | None,
                     chat: bool, echo: Echo | None = None):
        outputs = start(request, prompts, 1 if echo and echo.score_only else max_tokens)
        if echo and echo.score_only:
            outputs = generate_nothing(outputs)
        kind = ("chat.completion.chunk" if request.stream else "chat.completion") if chat else "text_completion"
        header = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", object=kind, model=model_name)
        k = request.num_logprobs()
        if k is not None and tokenizer is None:
            raise APIError(400, "logprobs: this model folder has no tokenizer to spell the tokens", "logprobs")
        logprobs = None if k is None else LogprobsFormat(tokenizer, chat, k)
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            events = stream_events(outputs, header, chat, len(prompts) * request.n, request.n, logprobs, include_usage,
                                   echo, ToolCallStream.of(request, tool_call_parser))
            return StreamingResponse(events, media_type="text/event-stream")
        response = await cancel_on_disconnect(collect(outputs, header, chat, request.n, logprobs, echo), raw)
        return with_tool_calls(response, request, tool_call_parser) if chat else response

    @v1.post("/completions")
    async def completions(request: CompletionRequest, raw: Request):
        prompts = request.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        try:  # as LLM.generate does it: text through the tokenizer, token ids as they are
            token_ids = [prompt_token_ids(tokenizer, p) for p in prompts]
        except ValueError as e:
            raise as_api_error(e, request) from e
        echo = make_echo(request, prompts, token_ids, tokenizer)
        return await answer(request, raw, token_ids or [[]], request.max_tokens, chat=False, echo=echo)

    @v1.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        if tokenizer is None:
            raise APIError(400, "messages: this model folder has no tokenizer, so no chat template", "messages")
        messages = conversation(request.messages, tokenizer.chat_template)  # tool calls and results too
        try:
            text = tokenizer.apply_chat_template(messages, tools=chat_tools(request), tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as e:  # the template's own checks (jinja2 raises for roles it does not know)
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages") from e
        # As in LLM.chat: the template already holds any special tokens, so encode must not add them again.
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
        return await answer(request, raw, [token_ids], max_tokens, chat=True)

    @v1.get("/models")
    async def models():
        card = dict(id=model_name, object="model", created=0, owned_by="nanoserve", max_model_len=config.max_model_len)
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def prometheus_metrics():
        return HTTPResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if dashboard:
        add_dashboard(app, engine, model_name, api_key)
    add_error_handlers(app)
    return app
