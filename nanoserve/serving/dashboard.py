"""`nanoserve serve --dashboard`: the engine at work, live, for a workshop's projector (GET
/dashboard).

The engine thread hands each step's record (step_records.py) to a `StepStream`, a listener of the
engine core's step recorder (the server builds its engine with `step_records=True` for it). It
turns the record into the page's JSON and keeps the last `max_records` of them in a bounded buffer,
the oldest dropped; every `interval` seconds, and when the engine falls idle (after a step or an
abort), it also reads the KV pools block by block and the queues with each request's progress,
there in the engine thread, where nothing changes under it. GET /debug/steps sends each browser what
is new up to that reading, as one server-sent event at most every `interval` seconds: a browser that
falls behind misses records (the event says how many), an absent one costs nothing, the engine never
waits for either. Without --dashboard the engine has no recorder and records nothing.

dashboard.html (plain JavaScript and SVG, nothing to install, nothing fetched from elsewhere) reads
only the JSON that `step_json`, `read_engine` and `refusals` write: when the engine's records
change, these are the place to adapt.
"""
import asyncio
import contextlib
import hmac
import json
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict
from itertools import islice
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, StreamingResponse

from nanoserve.config import Config
from nanoserve.kv_transfer import KVTransferEngineCore
from nanoserve.scheduling.swap import SwapScheduler
from nanoserve.serving.protocol import APIError
from nanoserve.sliding_window import SlidingWindowBlockManager
from nanoserve.step_records import StepReader, StepRecord, StepRecordsEngineCore, StepView

PAGE = Path(__file__).with_name("dashboard.html")
COOKIE = "nanoserve_api_key"


def step_json(rec: StepRecord, view: StepView) -> dict:
    """One step as the page reads it (request ids: the engine's sequence ids, which the page calls
    R0, R1...)."""
    return dict(
        step=rec.step, kind=rec.kind, time=rec.time,
        # spec: [drafts accepted, drafts proposed], for a verifying sequence only;
        # lora: the LoRA adapter's name, for a sequence that computes with one
        batch=[dict(seq=r.seq_id, tokens=r.num_tokens, sampled=r.sampled, decode=r.is_decode,
                    label=view.labels[r.seq_id],
                    **({"spec": view.spec[r.seq_id]} if r.seq_id in view.spec else {}),
                    **({"lora": r.lora_name} if r.lora_name else {}))
               for r in rec.scheduled],
        states=view.states, hits=view.hits,  # (JSON turns the ids that key them into strings)
        recomputed=rec.recomputed, swapped_out=rec.swapped_out, swapped_in=rec.swapped_in,
        finished=rec.finished,
        # beam search: [new beam, parent] pairs; beams freed
        forked=rec.forked, dropped=rec.dropped,
        # sliding-window attention: blocks given back so far
        freed_behind_window=rec.num_freed_behind_window,
        waiting=rec.waiting, running=rec.running, swapped=rec.swapped,
        blocks=dict(used=rec.num_used_blocks, cached=rec.num_cached_blocks,
                    free=rec.num_free_blocks),
        tokens=rec.num_scheduled_tokens, budget=rec.token_budget,
    )


def page_config(c: Config, model_name: str) -> dict:
    """The engine's settings, which the page's header shows (the first event of every stream)."""
    scheduling = c.scheduler_config
    return dict(model=model_name, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                max_num_batched_tokens=c.max_num_batched_tokens,
                enable_chunked_prefill=c.enable_chunked_prefill,
                enable_prefix_caching=c.enable_prefix_caching,
                preemption_mode=scheduling.preemption_mode,
                scheduling_policy=scheduling.scheduling_policy,
                async_scheduling=scheduling.async_scheduling,
                speculative_config=asdict(c.speculative_config) if c.speculative_config else None)


def read_engine(core, max_blocks: int, max_requests: int) -> dict:
    """The KV pools block by block (the first max_blocks of each), the requests in each queue (the
    first max_requests) with their progress, and the scheduler's counters. Only in the engine
    thread, or while it has nothing to do: this walks what every step changes."""
    scheduler, pool = core.scheduler, core.block_manager
    queues = scheduler.queues()
    queues.setdefault("swapped", [])  # (the swap chapter's third queue; empty without it)
    # The swap chapter's pool in host memory, if plugged in.
    host = (scheduler.host_block_manager if isinstance(scheduler, SwapScheduler) and scheduler.swap
            else None)
    holders: dict[int, list[int]] = {}  # device block -> the sequences whose block table holds it
    # the same in the host pool, for the swapped-out sequences
    host_holders: dict[int, list[int]] = {}
    for where, queue in ((holders, scheduler.running), (host_holders, queues["swapped"])):
        for seq in queue:
            for block_id in seq.block_table:
                if block_id < max_blocks and block_id != pool.null_block:  # (sliding_window/'s)
                    where.setdefault(block_id, []).append(seq.seq_id)
    # Each block: [ref_count, 1 if its hash is in the prefix cache (a prompt with that prefix can
    # take it), the sequences holding it]; a host block: the sequences holding it.
    blocks = [[b.ref_count, int(b.hash != -1 and pool.hash_to_block_id.get(b.hash) == b.block_id),
               holders.get(b.block_id, [])] for b in pool.blocks[:max_blocks]]
    num_host_blocks = min(host.num_blocks, max_blocks) if host else 0
    host_blocks = [host_holders.get(i, []) for i in range(num_host_blocks)]
    requests = [dict(seq=seq.seq_id, request=seq.request_id, queue=name,
                     prompt=seq.num_prompt_tokens, generated=seq.num_completion_tokens,
                     max_tokens=seq.sampling_params.max_tokens, cached=seq.num_cached_tokens)
                for name, queue in queues.items() for seq in islice(queue, max_requests)]
    # The prefix cache's host tier (kv_offload/), in counts; None when off
    num_tier_cached, num_tier_blocks = pool.num_offloaded_blocks()
    host_tier = None
    if num_tier_blocks:
        host_tier = dict(cached=num_tier_cached, num_blocks=num_tier_blocks)
    return dict(blocks=blocks, num_blocks=pool.num_blocks, host_blocks=host_blocks,
                num_host_blocks=host.num_blocks if host else 0, requests=requests,
                queue_lengths={name: len(queue) for name, queue in queues.items()},
                stats=asdict(scheduler.stats), host_tier=host_tier,
                kv_transfer=kv_transfer_json(core))


def refusals(core) -> dict | None:
    """The requests refused as never fitting the pool (sliding_window/: admitted by the window): how
    many so far, and the latest reasons; None on an engine without them. Read from the HTTP side: a
    refusal happens in the caller's thread, not in a step, and may come while the engine is idle."""
    pool = core.block_manager
    if not isinstance(pool, SlidingWindowBlockManager):
        return None
    return dict(num=pool.num_refused, reasons=list(pool.refused.copy()))  # (a deque copies at once)


def kv_transfer_json(core) -> dict | None:
    """Disaggregated prefill's counters (kv_transfer/): blocks sent, or received; None on an engine
    without it."""
    connector = core.kv_connector if isinstance(core, KVTransferEngineCore) else None
    if connector is None:
        return None
    error = connector.pipe.error
    return dict(kv_role=connector.config.kv_role, num_sent_blocks=connector.pipe.num_sent_blocks,
                **asdict(connector.stats), error=None if error is None else str(error))


class StepStream:
    """The step records, from the engine thread (`record`, a step listener) to the HTTP side
    (`since`)."""

    def __init__(self, core, interval: float = 0.25, max_records: int = 2000,
                 max_blocks: int = 4096, max_requests: int = 64):
        self.core, self.interval = core, interval
        self.max_blocks, self.max_requests = max_blocks, max_requests
        # (engine thread only) each request's state, its tokens, cache hits
        self.reader = StepReader()
        self.records: deque[dict] = deque(maxlen=max_records)  # full: the oldest is dropped
        self.num_records = 0  # records made so far; the buffer holds the last of them
        self.engine: dict | None = None  # the latest read_engine
        self.engine_time = float("-inf")
        self.num_records_read = 0  # how many records there were when it was read
        self.lock = threading.Lock()  # held for an append or a copy, never for longer

    def read_engine(self) -> dict:
        return read_engine(self.core, self.max_blocks, self.max_requests)

    def record(self, rec: StepRecord | None) -> None:
        """The step listener: the engine thread calls it after each step, and with None after an
        abort between steps. An abort that leaves the engine idle has no step to come after it: read
        the engine now."""
        if rec is None:
            if self.core.scheduler.is_finished():
                engine = self.read_engine()
                with self.lock:
                    self.engine = engine
            return
        step = step_json(rec, self.reader.read(rec))
        engine = None
        idle = not (rec.waiting or rec.running or rec.swapped)
        if rec.time - self.engine_time >= self.interval or idle:
            # (idle: the page must see the last state)
            engine, self.engine_time = self.read_engine(), rec.time
        with self.lock:
            self.records.append(step)
            self.num_records += 1
            if engine is not None:
                self.engine, self.num_records_read = engine, self.num_records

    def since(self, cursor: int) -> tuple[list[dict], int, dict | None, int]:
        """For a reader that has had the first `cursor` records: the newer ones still in the buffer
        up to the latest engine state (later ones wait for the next, so that the page never shows a
        step its blocks and queues do not), how many it missed (dropped before it came), that engine
        state, and its next cursor."""
        with self.lock:
            # the number of the oldest record in the buffer
            first = self.num_records - len(self.records)
            start = max(cursor, first)
            end = max(self.num_records_read, start)
            records = list(islice(self.records, start - first, end - first))
            return records, start - cursor, self.engine, end


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def stream_steps(stream: StepStream, config: dict, stopping: asyncio.Event,
                       backlog: int = 60) -> AsyncIterator[str]:
    """Server-sent events for one browser: `config` once, then a `steps` event at most every
    interval with the records since the last one (the `backlog` last ones first), `dropped` (how
    many it missed), the engine state if it changed and the refusals. Ends when the server shuts
    down."""
    cursor, sent, sent_refused = max(stream.num_records - backlog, 0), None, None
    yield event("config", config)
    while not stopping.is_set():
        records, dropped, engine, cursor = stream.since(cursor)
        refused = refusals(stream.core)
        if records or dropped or engine is not sent or refused != sent_refused:
            yield event("steps", dict(steps=records, dropped=dropped,
                                      engine=None if engine is sent else engine, refused=refused))
            sent, sent_refused = engine, refused
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), stream.interval)


def sent_keys(request: Request) -> list[str]:
    """The API keys a request brings: `Authorization: Bearer KEY` (curl), `?api_key=KEY` (a link),
    or the cookie that /dashboard?api_key=KEY sets (a browser's EventSource cannot send headers; it
    sends cookies)."""
    auth = request.headers.get("authorization", "")
    keys = [auth.removeprefix("Bearer ")] if auth.startswith("Bearer ") else []
    others = (request.query_params.get("api_key"), request.cookies.get(COOKIE))
    return keys + [k for k in others if k]


def add_dashboard(app: FastAPI, engine, model_name: str, api_key: str | None) -> None:
    """GET /dashboard (the page) and GET /debug/steps (its events), behind the server's API key when
    it has one. `engine` is the AsyncLLM, built with step_records=True: the stream listens to its
    engine core's step recorder."""
    core = engine.engine_core
    if not isinstance(core, StepRecordsEngineCore) or core.step_recorder is None:
        raise ValueError("dashboard: the engine makes no step records; build it with "
                         "step_records=True (nanoserve serve --dashboard does)")
    stream = StepStream(core)
    # The server takes no request yet: the engine thread is idle.
    stream.engine = stream.read_engine()
    core.step_recorder.listeners.append(stream)
    config = page_config(core.config, model_name)
    page = PAGE.read_text()

    def check_key(request: Request) -> None:
        if api_key and not any(hmac.compare_digest(k.encode(), api_key.encode())
                               for k in sent_keys(request)):
            raise APIError(401, "Incorrect or missing API key: open /dashboard?api_key=KEY, or "
                           "send `Authorization: Bearer KEY`", code="invalid_api_key")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request):
        check_key(request)
        if api_key and "api_key" in request.query_params:
            # a cookie for the page's stream, and the key off
            # the address bar (the projector shows it)
            url = request.url.remove_query_params("api_key")
            response = RedirectResponse(url.path + (f"?{url.query}" if url.query else ""),
                                        status_code=303)
            response.set_cookie(COOKIE, api_key, httponly=True, samesite="strict")
            return response
        return HTMLResponse(page)

    @app.get("/debug/steps", include_in_schema=False)
    async def debug_steps(request: Request):
        check_key(request)
        return StreamingResponse(stream_steps(stream, config, app.state.stopping),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
