import asyncio
import contextlib
import gc
import queue
import threading
from collections.abc import AsyncIterator, Callable
from functools import partial
from itertools import count

from nanoserve.config import Config, make_config
from nanoserve.engine.core import EngineCore, EngineCoreOutput
from nanoserve.engine.output_processor import RequestState
from nanoserve.llm import Prompt, prompt_text, prompt_token_ids
from nanoserve.lora_request import LoRARequest
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams


class RequestQueues(dict):
    """request_id -> (its event loop, its asyncio.Queue). This is the busy loop's output queue: the
    engine thread hands each output over to the loop of the coroutine that waits for it."""

    def put_nowait(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            entry = self.get(out.request_id)
            if entry is not None:
                loop, request_queue = entry
                with contextlib.suppress(RuntimeError):
                    # that loop is closed: nobody listens any more
                    loop.call_soon_threadsafe(request_queue.put_nowait, out)


def run_busy_loop(engine: EngineCore, input_queue: queue.Queue, output_queue) -> None:
    """The engine's thread (vLLM's EngineCoreProc.run_busy_loop). Take in ("add", request_id, add)
    (add() queues the request: engine.add_request with its arguments, or a feature's own), ("abort",
    request_id), ("shutdown", None); step while there is work; put each step's outputs on
    output_queue."""
    # as LLM.generate: the heap so far (torch, the model) is left out of full collections
    gc.freeze()
    try:
        while True:
            # Idle, get() sleeps until a request comes (no spinning); busy, it takes only what has
            # come.
            while not engine.has_unfinished_requests() or not input_queue.empty():
                kind, request_id, *args = input_queue.get()
                if kind == "shutdown":
                    return
                if kind == "abort" and engine.abort_request(request_id):
                    # tell whoever waits for it
                    output_queue.put_nowait([EngineCoreOutput(request_id, [], finished=True,
                                                              finish_reason="abort")])
                elif kind == "add":
                    add: Callable[[], None] = args[0]
                    try:
                        add()
                    except ValueError as error:
                        # a bad request: its caller hears why, the others go on
                        output_queue.put_nowait([EngineCoreOutput(request_id, [], finished=True,
                                                                  error=error)])
            try:
                outputs = engine.step()
            except Exception as error:
                # a bug outside the forward: fail everyone rather than leave them waiting
                outputs = engine.fail_all(error)
            if outputs:
                output_queue.put_nowait(outputs)
    finally:
        gc.unfreeze()


class AsyncLLM:
    """The streaming front end (vLLM's AsyncLLM), constructed like LLM. The EngineCore's busy loop
    runs in a background thread; `generate` sends a request down its input queue and yields
    RequestOutputs as steps produce tokens. Leaving the `async for` early, or cancelling its task,
    aborts the request."""

    # as LLM's: nanoserve.AsyncLLM plugs the features in
    build_engine: Callable[[Config], EngineCore] = EngineCore

    def __init__(self, model: str | None = None, **kwargs):
        self.engine_core = type(self).build_engine(make_config(model, kwargs))
        self.config, self.tokenizer = self.engine_core.config, self.engine_core.tokenizer
        self.input_queue: queue.Queue = queue.Queue()
        self.queues = RequestQueues()
        self.request_ids = count()
        self.thread = threading.Thread(target=run_busy_loop,
                                       args=(self.engine_core, self.input_queue, self.queues),
                                       name="nanoserve-engine-core", daemon=True)
        self.thread.start()

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        params = sampling_params or SamplingParams()
        token_ids = prompt_token_ids(self.tokenizer, prompt)
        request_id = str(next(self.request_ids)) if request_id is None else request_id
        # fails here, not in the loop
        self.engine_core.check_request(token_ids, params, priority, lora_request)
        state = RequestState(request_id, prompt_text(prompt), token_ids, params.output_kind,
                             params.n)
        add = partial(self.engine_core.add_request, request_id, token_ids, params, priority,
                      lora_request)
        async for output in self._stream(state, ("add", request_id, add)):
            yield output

    async def _stream(self, state: RequestState, message: tuple) -> AsyncIterator[RequestOutput]:
        """Send the busy loop the request's message, then yield its outputs (state gathers them) as
        steps come."""
        request_id = state.request_id
        if request_id in self.queues:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not self.thread.is_alive():
            raise RuntimeError("AsyncLLM: the engine is shut down")
        request_queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self.queues[request_id] = asyncio.get_running_loop(), request_queue
        self.input_queue.put(message)
        finished = False
        try:
            while not finished:
                out = await request_queue.get()
                if out.error is not None:
                    raise out.error
                output = state.update(out)
                finished = state.finished
                if output is not None:
                    yield output
        finally:
            # also when the caller stopped listening (break, cancel): free the request's blocks
            del self.queues[request_id]
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request from any thread; its `async for` ends with finish_reason "abort"."""
        self.input_queue.put(("abort", request_id))

    def shutdown(self) -> None:
        """Stop the busy loop; requests still running get an error instead of waiting forever."""
        if self.thread.is_alive():
            self.input_queue.put(("shutdown", None))
            self.thread.join()
        self.engine_core.shutdown()
        error = RuntimeError("AsyncLLM: the engine was shut down")
        self.queues.put_nowait([EngineCoreOutput(request_id, [], finished=True, error=error)
                                for request_id in list(self.queues)])
