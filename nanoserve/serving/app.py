"""The FastAPI app: OpenAI's routes on top of `AsyncLLM`.

A request's path: FastAPI parses the JSON into a `protocol` model (400 if it does not fit) -> the
route turns the prompt or the chat messages into token ids and the fields into a `SamplingParams`,
and the engine checks them (400 if it refuses) -> one `engine.generate(...)` stream per prompt; the
engine core's busy loop puts the request into its scheduler's waiting queue and, step after step,
sends back the newly decoded text (DELTA outputs) -> the route forwards each piece as a server-sent
event, or gathers them into one JSON answer (answers.py). A client that goes away cancels the task
that iterates its stream, which aborts the request. Beside it: responses.py (the Responses API,
answered by the chat route), tokenization.py (the chat template, /tokenize and vLLM's other utility
routes), beam.py (`use_beam_search`: engine.beam_search instead), echo.py, structured.py,
logprobs.py, errors.py (every error in OpenAI's shape), metrics.py, dashboard.py, lora.py (the
models served: the base model and its LoRA adapters, which a request's `model` picks).
"""
import asyncio
import uuid
from collections.abc import AsyncIterator
from time import perf_counter

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response as HTTPResponse
from fastapi.responses import StreamingResponse

from nanoserve import kv_transfer
from nanoserve.llm import prompt_token_ids
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import RequestOutputKind, SamplingParams
from nanoserve.serving.answers import Chunks, Outputs, collect, server_sent_events, stream_chunks
from nanoserve.serving.beam import beam_search_streams, check_beam_fields
from nanoserve.serving.dashboard import add_dashboard
from nanoserve.serving.echo import Echo, generate_nothing, make_echo
from nanoserve.serving.errors import APIKeyMiddleware, add_error_handlers
from nanoserve.serving.logprobs import LogprobsFormat
from nanoserve.serving.lora import LoRAModulePath, ServedModels, add_lora_routes
from nanoserve.serving.metrics import Metrics
from nanoserve.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Response,
    SamplingRequest,
)
from nanoserve.serving.responses import add_responses
from nanoserve.serving.structured import structured_outputs_params, with_tool_calls
from nanoserve.serving.tokenization import add_tokenization_routes, render_chat
from nanoserve.serving.tool_stream import ToolCallStream
from nanoserve.structured_outputs import StructuredOutputsParams

# whole, streamed, or 499 (the client went away before the answer)
Answer = Response | Chunks | HTTPResponse


# ---- from the request to the engine --------------------------------------------------------------
def refuse_unsupported(request: SamplingRequest) -> None:
    check_beam_fields(request)  # beam search's fields without it, or sampling's with it
    if getattr(request, "top_logprobs", None) is not None and not request.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")


def check_length(request: SamplingRequest, prompt: list[int], max_tokens: int | None,
                 max_model_len: int) -> None:
    """A prompt + max_tokens over max_model_len: `param` names the prompt if it leaves no room at
    all, else max_tokens (the engine's own check cannot tell which field the client should
    change)."""
    prompt_field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if len(prompt) >= max_model_len:
        raise APIError(400, f"{prompt_field}: {len(prompt)} tokens leave no room for an answer "
                       f"within max_model_len ({max_model_len})", prompt_field)
    if max_tokens is not None and len(prompt) + max_tokens > max_model_len:
        raise APIError(400, f"max_tokens: {max_tokens} + the prompt's {len(prompt)} tokens exceeds "
                       f"max_model_len ({max_model_len}); at most {max_model_len - len(prompt)}",
                       "max_tokens")


def sampling_params(request: SamplingRequest, max_tokens: int | None, room: int,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """room: what max_model_len leaves after the prompt, the default max_tokens (as in vLLM)."""
    return SamplingParams(n=request.n, temperature=request.temperature, top_p=request.top_p,
                          top_k=request.top_k, min_p=request.min_p,
                          presence_penalty=request.presence_penalty,
                          frequency_penalty=request.frequency_penalty,
                          repetition_penalty=request.repetition_penalty,
                          logprobs=request.num_logprobs(),
                          prompt_logprobs=request.num_prompt_logprobs(),
                          max_tokens=max(room, 1) if max_tokens is None else max_tokens,
                          min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
                          stop_token_ids=request.stop_token_ids or [], stop=request.stop,
                          include_stop_str_in_output=request.include_stop_str_in_output,
                          seed=request.seed, output_kind=RequestOutputKind.DELTA,
                          structured_outputs=structured_outputs,
                          kv_transfer_params=request.kv_transfer_params)


def as_api_error(e: ValueError, request: SamplingRequest) -> APIError:
    """The engine's messages start with the field they are about ("temperature must be ..."): that
    is `param`."""
    first_word = str(e).split(" ", 1)[0].rstrip(":")
    fields = type(request).model_fields
    return APIError(400, str(e), first_word if first_word in fields else None)


async def merge(streams: list[AsyncIterator[RequestOutput]],
                shutting_down: asyncio.Event) -> Outputs:
    """Interleave the prompts' streams as their outputs come. Closing this cancels them all, which
    aborts them in the engine; so does a server shutdown whose grace period ran out (then this
    raises a 503)."""
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
        error = APIError(503, "the server is shutting down: request aborted", type="server_error")
        await queue.put((-1, None, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    tasks.append(asyncio.create_task(watch()))
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


async def cancel_on_disconnect(work, raw: Request):
    """Run `work` (a non-streamed answer) unless the client disconnects first; then cancel it
    (aborting)."""
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


# ---- the app -------------------------------------------------------------------------------------
def build_app(engine, model_name: str, api_key: str | None = None,
              tool_call_parser: str | None = None, dashboard: bool = False,
              lora_modules: list[LoRAModulePath] = (),
              allow_runtime_lora_updating: bool = False) -> FastAPI:
    """engine: an `AsyncLLM`; model_name: what /v1/models lists and requests name for the base
    model; tool_call_parser ("hermes"): answer tool_choice "auto" (--enable-auto-tool-choice
    --tool-call-parser); dashboard: serve the live view of the engine at /dashboard
    (serving/dashboard.py); lora_modules: the adapters served under their own names (--lora-modules,
    needs enable_lora), and with allow_runtime_lora_updating the routes that load and unload them
    (serving/lora.py). A bad adapter is a ValueError naming it, before the server starts."""
    core, tokenizer = engine.engine_core, engine.tokenizer
    config = core.config
    models = ServedModels(core, model_name, config.max_model_len)
    for module in lora_modules:
        models.add(module.name, module.path)
    metrics = Metrics(core, model_name)
    app = FastAPI(title="nanoserve", summary="An OpenAI-compatible server for the nanoserve engine")
    # set when a shutdown's grace period is over: abort what runs
    app.state.shutting_down = asyncio.Event()
    # set when a shutdown begins: endless streams (/debug/steps) end
    app.state.stopping = asyncio.Event()
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    v1 = APIRouter(prefix="/v1")

    def start(request: SamplingRequest, prompts: list[list[int]],
              max_tokens: int | None) -> Outputs:
        """Check everything, then submit one engine request per prompt: bad input is a 400 before
        any work."""
        arrival = perf_counter()
        # the base model (None), an adapter, or a 404
        lora_request = models.lora_request(request.model)
        refuse_unsupported(request)
        if lora_request is not None and request.use_beam_search:
            raise APIError(400, "use_beam_search: not supported with a LoRA adapter yet",
                           "use_beam_search")
        for p in prompts:
            check_length(request, p, max_tokens, config.max_model_len)
        # response_format, tools, ...
        structured = structured_outputs_params(request, tool_call_parser)
        request_id = uuid.uuid4().hex
        try:
            if request.use_beam_search:  # vLLM's extension (serving/beam.py)
                streams = beam_search_streams(engine, request, prompts, max_tokens, request_id)
            else:
                params = [sampling_params(request, max_tokens, config.max_model_len - len(p),
                                          structured)
                          for p in prompts]
                for ids, sp in zip(prompts, params):
                    core.check_request(ids, sp, request.priority, lora_request)
                streams = [engine.generate(ids, sp, request_id=f"{request_id}-{i}",
                                           priority=request.priority, lora_request=lora_request)
                           for i, (ids, sp) in enumerate(zip(prompts, params))]
        except ValueError as e:
            raise as_api_error(e, request) from e
        return merge([metrics.observe(stream, arrival) for stream in streams],
                     app.state.shutting_down)

    async def answer(request: SamplingRequest, raw: Request, prompts: list[list[int]],
                     max_tokens: int | None, chat: bool, echo: Echo | None = None) -> Answer:
        outputs = start(request, prompts, 1 if echo and echo.score_only else max_tokens)
        if echo and echo.score_only:
            outputs = generate_nothing(outputs)
        chat_kind = "chat.completion.chunk" if request.stream else "chat.completion"
        kind = chat_kind if chat else "text_completion"
        header = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", object=kind,
                      # (an adapter's answers carry its name, as in vLLM)
                      model=request.model or model_name)
        k = request.num_logprobs()
        if k is not None and tokenizer is None:
            raise APIError(400, "logprobs: this model folder has no tokenizer to spell the tokens",
                           "logprobs")
        logprobs = None if k is None else LogprobsFormat(tokenizer, chat, k)
        if request.stream:
            options = request.stream_options
            include_usage = options is not None and options.include_usage
            return stream_chunks(outputs, header, chat, len(prompts) * request.n, request.n,
                                 logprobs, include_usage, echo,
                                 ToolCallStream.of(request, tool_call_parser))
        whole = collect(outputs, header, chat, request.n, logprobs, echo)
        response = await cancel_on_disconnect(whole, raw)
        # a prefill instance tells where its KV is (serving/proxy.py)
        if isinstance(response, Response):
            response.kv_transfer_params = kv_transfer.remote_prefill_params(
                core, request.kv_transfer_params)
        if chat and isinstance(response, Response):
            return with_tool_calls(response, request, tool_call_parser)
        return response

    def reply(request: SamplingRequest, answer: Answer):
        if not request.stream:
            return answer
        return StreamingResponse(server_sent_events(answer), media_type="text/event-stream")

    @v1.post("/completions")
    async def completions(request: CompletionRequest, raw: Request):
        prompts = request.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        try:  # as LLM.generate does it: text through the tokenizer, token ids as they are
            token_ids = [prompt_token_ids(tokenizer, p) for p in prompts]
        except ValueError as e:
            raise as_api_error(e, request) from e
        echo = make_echo(request, prompts, tokenizer)
        whole = await answer(request, raw, token_ids or [[]], request.max_tokens, chat=False,
                             echo=echo)
        return reply(request, whole)

    async def chat(request: ChatCompletionRequest, raw: Request) -> Answer:
        token_ids = render_chat(tokenizer, request.messages, request.tools)
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        return await answer(request, raw, [token_ids], max_tokens, chat=True)

    @v1.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        return reply(request, await chat(request, raw))

    add_responses(v1, chat, model_name)  # POST /v1/responses

    @v1.get("/models")
    async def list_models():
        return {"object": "list", "data": models.cards()}

    if allow_runtime_lora_updating:  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
        add_lora_routes(v1, models)

    app.include_router(v1)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def prometheus_metrics():
        return HTTPResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # /tokenize, /version, ...
    add_tokenization_routes(app, tokenizer, models.lora_request, config.max_model_len)
    if dashboard:
        add_dashboard(app, engine, model_name, api_key)
    add_error_handlers(app)
    return app
