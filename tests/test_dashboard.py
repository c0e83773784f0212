"""`nanoserve serve --dashboard`: the step-record stream (what it sends, how often, what it drops, and that nothing
is recorded without it), its endpoints behind the API key, and the page itself in a real browser (headless
Chromium, driven by Playwright) against a real server whose tiny KV pool forces preemptions and prefix hits."""
import asyncio
import contextlib
import json
import re
import shutil
import signal
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from test_lora import make_adapter

from conftest import Listener, Server, start_server
from nanoserve import LLM, AsyncLLM, LoRARequest, SamplingParams
from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.serving.app import build_app
from nanoserve.serving.dashboard import PAGE, StepStream, event, page_config, stream_steps
from nanoserve.step_records import StepRecord, StepRecordsEngineCore
from nanoserve.tools.trace_pictures import LORA_COLOURS, STATES

GREEDY = SamplingParams(temperature=0, ignore_eos=True, max_tokens=8)


def engine_with_stream(model: str, **options) -> tuple[LLM, StepStream, list[dict]]:
    """An LLM whose every step goes through a StepStream that reads the engine at every step (interval 0);
    the list collects the engine state after each step."""
    llm = LLM(model, block_size=4, max_model_len=128, step_records=True, **options)
    stream, states = StepStream(llm.engine, interval=0), []
    llm.engine.step_recorder.listeners += [stream, Listener(lambda rec: states.append(stream.engine))]
    return llm, stream, states


def records(stream: StepStream) -> list[dict]:
    steps, dropped, _, _ = stream.since(0)
    assert dropped == 0
    return json.loads(json.dumps(steps))  # as the page gets them


# ---- the stream -----------------------------------------------------------------------------------------
def test_records_steps_blocks_and_requests(tiny_models):
    """The default scenario of the trace tool (docs/workshop.md, exercise 2): A, B, C, D (8, 6, 5, 5 tokens) in
    8 blocks of 4 tokens. Step 0 prefills all four; in step 1 A needs a third block and D, the newest, is
    preempted. The records and the blocks, exactly."""
    llm, stream, states = engine_with_stream(tiny_models["qwen3"], num_kvcache_blocks=8)
    for name, n in zip("ABCD", (8, 6, 5, 5)):
        llm.engine.add_request(name, [ord(name) + 10 * j for j in range(n)], GREEDY)
    llm.engine.step()
    llm.engine.step()
    step0, step1 = records(stream)
    assert step0 == dict(
        step=0, kind="prefill", time=step0["time"],
        batch=[dict(seq=i, tokens=n, sampled=True, decode=False, label=str(n)) for i, n in enumerate((8, 6, 5, 5))],
        states={"0": "prefill", "1": "prefill", "2": "prefill", "3": "prefill"}, hits={},
        recomputed=[], swapped_out=[], swapped_in=[], finished=[], forked=[], dropped=[], freed_behind_window=0,
        waiting=[], running=[0, 1, 2, 3], swapped=[],
        blocks=dict(used=8, cached=0, free=0), tokens=24, budget=llm.engine.config.max_num_batched_tokens)
    assert step1["recomputed"] == [3] and step1["waiting"] == [3] and step1["running"] == [0, 1, 2]
    assert step1["states"] == {"0": "decode", "1": "decode", "2": "decode", "3": "preempted"}
    assert [b["label"] for b in step1["batch"]] == ["1", "1", "1"]
    # Blocks: [ref_count, hash in the prefix cache, holders]. The full blocks are hashed once computed: A's two,
    # the first of B, C, D. D's blocks go back (its full one stays cached), and A takes block 7 for its ninth token.
    assert states[0]["blocks"] == [[1, 1, [0]], [1, 1, [0]], [1, 1, [1]], [1, 0, [1]],
                                   [1, 1, [2]], [1, 0, [2]], [1, 1, [3]], [1, 0, [3]]]
    assert states[1]["blocks"][6:] == [[0, 1, []], [1, 0, [0]]]
    assert [(r["seq"], r["request"], r["queue"], r["generated"]) for r in states[1]["requests"]] == [
        (3, "D", "waiting", 1), (0, "A", "running", 2), (1, "B", "running", 2), (2, "C", "running", 2)]
    assert states[1]["queue_lengths"] == {"waiting": 1, "running": 3, "swapped": 0}
    assert states[1]["stats"]["num_preemptions"] == 1 and states[1]["host_blocks"] == []


def test_records_prefix_hits_shared_blocks_and_swaps(tiny_models):
    """A second prompt with the first one's 8-token prefix starts at 8 ("4@8") and shares its two blocks
    (ref count 2); with preemption_mode="swap" a preempted request's blocks show in the host pool."""
    llm, stream, states = engine_with_stream(tiny_models["qwen3"], num_kvcache_blocks=8, preemption_mode="swap",
                                             swap_space=0.001)
    prefix, params = list(range(20, 28)), SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)
    llm.engine.add_request("first", prefix + [40, 41], params)
    llm.engine.step()
    llm.engine.add_request("second", prefix + [50, 51, 52, 53], params)
    llm.engine.step()
    second = records(stream)[1]
    assert second["hits"] == {"1": 8} and [b["label"] for b in second["batch"]] == ["4@8"]
    assert [b[:2] for b in states[1]["blocks"][:2]] == [[2, 1], [2, 1]] and states[1]["blocks"][0][2] == [0, 1]
    assert [r["cached"] for r in states[1]["requests"]] == [0, 8]
    while not any(rec["swapped_out"] for rec in records(stream)):  # both grow until one is swapped out
        assert llm.engine.has_unfinished_requests()
        llm.engine.step()
    state = states[-1]
    swapped = [r["seq"] for r in state["requests"] if r["queue"] == "swapped"]
    assert swapped and sum(holders == swapped for holders in state["host_blocks"]) >= 2
    assert state["num_host_blocks"] == len(state["host_blocks"]) == llm.engine.scheduler.host_block_manager.num_blocks


def test_engine_read_at_most_every_interval_and_when_idle(tiny_models):
    """The blocks and queues are read at the first step (the interval is an hour) and when the engine falls idle;
    the steps in between wait for the second reading, so the page never shows steps ahead of its blocks."""
    llm = LLM(tiny_models["qwen3"], block_size=4, num_kvcache_blocks=16, step_records=True)
    stream, reads, sent = StepStream(llm.engine, interval=3600), [], []
    stream.read_engine = lambda: reads.append(len(llm.engine.scheduler.running)) or {"reading": len(reads)}
    llm.engine.step_recorder.listeners += [stream, Listener(lambda rec: sent.append(stream.since(0)))]
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)  # 8 steps
    assert reads == [1, 0] and stream.num_records == 8
    assert [(len(steps), engine) for steps, _, engine, _ in sent] == [(1, {"reading": 1})] * 7 + [(8, {"reading": 2})]


def test_an_abort_that_leaves_the_engine_idle_is_read(tiny_models):
    """Aborts make no step; the last one, which leaves the engine idle with no step to come, is read at once."""
    llm = LLM(tiny_models["qwen3"], block_size=4, num_kvcache_blocks=16, step_records=True)
    stream = StepStream(llm.engine, interval=3600)
    llm.engine.step_recorder.listeners.append(stream)
    for name in "AB":
        llm.engine.add_request(name, [ord(name), 5, 6, 7, 8], GREEDY)
    llm.engine.step()
    assert stream.engine["queue_lengths"]["running"] == 2
    llm.engine.abort_request("A")  # B runs on: its next step is read when the interval allows
    assert stream.engine["queue_lengths"]["running"] == 2
    llm.engine.abort_request("B")
    assert stream.engine["queue_lengths"] == {"waiting": 0, "running": 0, "swapped": 0}
    assert stream.engine["requests"] == [] and all(ref == 0 for ref, _, _ in stream.engine["blocks"])
    assert stream.num_records == 1


def make_record(step: int) -> StepRecord:
    return StepRecord(step=step, kind="idle", scheduled=[], recomputed=[], swapped_out=[], swapped_in=[],
                      finished=[], waiting=[], running=[], swapped=[], num_used_blocks=0, num_cached_blocks=0,
                      num_free_blocks=1, num_scheduled_tokens=0, token_budget=1, time=float(step), seq_requests={})


def idle_engine(model: str):
    """What a StepStream reads after a record with empty queues."""
    return LLM(model, block_size=4, num_kvcache_blocks=4).engine


def test_bounded_buffer_drops_the_oldest(tiny_models):
    """The engine thread only appends: a reader that comes late gets the last max_records and hears how many it
    missed; nobody reading costs a bounded buffer."""
    stream = StepStream(idle_engine(tiny_models["qwen3"]), max_records=5)
    for step in range(12):
        stream.record(make_record(step))
    steps, dropped, engine, cursor = stream.since(0)
    assert [s["step"] for s in steps] == [7, 8, 9, 10, 11] and dropped == 7 and cursor == 12
    assert engine["num_blocks"] == 4
    steps, dropped, _, cursor = stream.since(10)
    assert [s["step"] for s in steps] == [10, 11] and dropped == 0 and cursor == 12
    assert stream.since(12)[:2] == ([], 0) and len(stream.records) == 5


def test_events_are_batched_at_most_every_interval(tiny_models):
    """A thread records a step every millisecond; the stream sends one event per interval (0.1 s) with all the
    steps since the last, none lost, none twice, in order; it ends when the server stops."""
    stream = StepStream(idle_engine(tiny_models["qwen3"]), interval=0.1)
    num_steps = 300

    def engine_thread():
        for step in range(num_steps):
            stream.record(make_record(step))
            time.sleep(0.001)

    async def read() -> list[tuple[float, str]]:
        stopping, events, received = asyncio.Event(), [], 0
        async for text in stream_steps(stream, {"model": "m"}, stopping, backlog=0):
            events.append((time.monotonic(), text))
            if len(events) == 1:  # the config: now the engine starts
                threading.Thread(target=engine_thread).start()
            received += text.count('"step":')
            if received == num_steps:
                stopping.set()  # the generator ends
        return events

    events = asyncio.run(asyncio.wait_for(read(), 60))  # (a lost record would leave it waiting)
    assert events[0][1] == 'event: config\ndata: {"model":"m"}\n\n'
    batches = []
    for _, text in events[1:]:
        name, data = text.removesuffix("\n\n").split("\n")
        assert name == "event: steps" and data.startswith("data: ")
        batches.append(json.loads(data.removeprefix("data: ")))
    assert [s["step"] for b in batches for s in b["steps"]] == list(range(num_steps))
    assert all(b["dropped"] == 0 for b in batches)
    gaps = [b[0] - a[0] for a, b in zip(events[1:], events[2:])]
    assert min(gaps) >= 0.09 and len(batches) < num_steps / 10  # a handful of steps per event


def test_off_by_default_nothing_recorded(tiny_models, monkeypatch):
    """Without --dashboard (and without trace) the engine has no step recorder, makes no record, and the server
    has no dashboard routes; a dashboard on such an engine is refused."""
    def fail(*args):
        raise AssertionError("a step record was made")

    monkeypatch.setattr("nanoserve.step_records.record_step", fail)
    llm = LLM(tiny_models["qwen3"], block_size=4, num_kvcache_blocks=16)
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert not isinstance(llm.engine, StepRecordsEngineCore) and llm.trace is None
    engine = AsyncLLM(tiny_models["qwen3"], block_size=4, num_kvcache_blocks=16)
    try:
        client = TestClient(build_app(engine, "tiny"))
        assert client.get("/dashboard").status_code == 404 and client.get("/debug/steps").status_code == 404
        assert not isinstance(engine.engine_core, StepRecordsEngineCore)
        with pytest.raises(ValueError, match="dashboard: the engine makes no step records; build it with "
                                             "step_records=True"):
            build_app(engine, "tiny", dashboard=True)
    finally:
        engine.shutdown()


def test_page_colours_are_the_trace_tools():
    """The page draws the timeline in the trace tool's colours; both legends say the same."""
    page = PAGE.read_text()
    block = page[page.index("const STATES = {"):page.index("};", page.index("const STATES = {"))]
    entries = re.findall(r'"([a-z ]+)": \["(#[0-9a-f]{6})", "([^"]+)"\]', block)
    assert {name: (colour, label) for name, colour, label in entries} == {
        name: (colour, label) for name, (colour, _, label) in STATES.items() if name != "not arrived"}
    assert f"const LORA_COLOURS = {json.dumps(LORA_COLOURS)};" in page
    assert "http://" not in page and "https://" not in page  # works offline: nothing fetched from elsewhere


# ---- a real server: the endpoints, the page in a browser ---------------------------------------------------
API_KEY = "sk-dashboard"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# 12 blocks of 16 tokens and 4 sequences: four requests of 54-60 tokens that grow by 40 need 17 blocks, so one
# is preempted; its KV goes to 7 blocks of host memory (--swap-space: 0.005 GiB, at 0.7 MB a block).
SERVER_FLAGS = ["--dashboard", "--api-key", API_KEY, "--num-kvcache-blocks", "12", "--max-num-seqs", "4",
                "--preemption-mode", "swap", "--swap-space", "0.005", "--max-model-len", "256",
                "--shutdown-timeout", "60", "--uvicorn-log-level", "warning"]
BROWSER = shutil.which("chromium")
# On each browser test (a mark on a fixture or helper is ignored by pytest: the test would fail, not skip);
# tests/test_suite.py runs them with no chromium on PATH and checks that every one is skipped.
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no browser: `apt-get install chromium` (.ci/run does) "
                                   "to run it")
BROWSER_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    log = tmp_path_factory.mktemp("dashboard") / "server.log"
    url, process = start_server([str(converted[1]), *SERVER_FLAGS], log)
    yield Server(url, process, log)
    if process.poll() is None:  # the SIGTERM test did not run (-k)
        process.terminate()
        process.wait(30)


def first_event(server: Server, query: str = "", headers: dict | None = None) -> tuple[int, str]:
    """Open /debug/steps, read its first event, hang up."""
    with httpx.stream("GET", f"{server.url}/debug/steps{query}", headers=headers, timeout=30) as response:
        if response.status_code != 200:
            return response.status_code, response.read().decode()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        return 200, "\n".join([next(lines), next(lines)])


def test_endpoints_need_the_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, body = first_event(server, headers=headers)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/dashboard", headers=headers).status_code == 401
    assert first_event(server, "?api_key=wrong")[0] == 401
    for query, headers in (("", AUTH), (f"?api_key={API_KEY}", None)):  # curl's header, or a link's query
        status, text = first_event(server, query, headers)
        name, data = text.split("\n")
        config = json.loads(data.removeprefix("data: "))
        assert status == 200 and name == "event: config" and config["block_size"] == 16
        assert config["speculative_config"] is None
    # A browser: the key in the link becomes a cookie (its EventSource sends cookies, not headers), and the
    # address bar loses it.
    response = httpx.get(f"{server.url}/dashboard?steps=60&api_key={API_KEY}")
    assert response.status_code == 303 and response.headers["location"] == "/dashboard?steps=60"
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"nanoserve_api_key={API_KEY};") and "HttpOnly" in cookie
    page = httpx.get(f"{server.url}/dashboard", cookies={"nanoserve_api_key": API_KEY})
    assert page.status_code == 200 and "<title>nanoserve: the engine, live</title>" in page.text
    assert first_event(server, headers={"Cookie": f"nanoserve_api_key={API_KEY}"})[0] == 200
    assert httpx.get(f"{server.url}/dashboard", cookies={"nanoserve_api_key": "wrong"}).status_code == 401


def complete(server: Server, prompt: list[int], first_token: threading.Event) -> None:
    body = dict(prompt=prompt, max_tokens=40, ignore_eos=True, temperature=0, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                first_token.set()


def scrape(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@needs_browser
def test_page_in_a_browser(server, tmp_path):
    """Headless Chromium on the page while four requests run on a tiny pool. P2 shares P1's 48-token prompt
    prefix (a hit, 3 shared blocks); four requests need more blocks than there are, so one is swapped out. What
    the page shows, polled while they run: the queues, the block grid, the swap marker, the hit; then, idle, an
    empty pool (but for the cache) and the counters of /metrics."""
    playwright = pytest.importorskip("playwright.sync_api", reason="`pip install playwright` to run it")
    system = list(range(1000, 1048))  # 3 full blocks
    prompts = [system + [2000 + i for i in range(6)], system + [3000 + i for i in range(6)],
               [4000 + i for i in range(20)], [5000 + i for i in range(20)]]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=BROWSER, args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 900})
        errors = []
        page.on("pageerror", lambda error: errors.append(error))
        page.goto(f"{server.url}/dashboard?steps=100&api_key={API_KEY}")
        assert page.url == f"{server.url}/dashboard?steps=100"  # the key is off the address bar
        page.wait_for_selector("#status[data-status=idle]")
        assert page.locator("#kv-grid .block").count() == 12 and page.locator("#host-grid .block").count() == 7
        def count() -> dict:
            return page.evaluate("""() => ({
                running: document.querySelectorAll("#queue-running .req").length,
                swapped: document.querySelectorAll("#queue-swapped .req").length,
                used: document.querySelectorAll("#kv-grid .block[data-state=used]").length,
                shared: document.querySelectorAll("#kv-grid .block[data-state=shared]").length,
                host: document.querySelectorAll("#host-grid .block[data-state=host]").length,
                swap_marker: document.querySelectorAll("#timeline .marker[data-event=swapped_out]").length,
                hits: [...document.querySelectorAll("#events .event[data-kind=hit]")].map(e => e.textContent),
            })""")

        threads = []
        for prompt in prompts:  # one after the other: P1's prompt is in the prefix cache when P2 comes, and
            first_token = threading.Event()  # the newest, P4, is the first to be swapped out
            threads.append(threading.Thread(target=complete, args=(server, prompt, first_token)))
            threads[-1].start()
            assert first_token.wait(120)
        seen: dict[str, int] = {}
        while any(thread.is_alive() for thread in threads):
            now = count()
            if now["swapped"] and not seen.get("swapped"):
                page.screenshot(path=tmp_path / "dashboard.png")
            for key, value in now.items():
                seen[key] = max(seen.get(key, 0), len(value) if key == "hits" else value)
            time.sleep(0.05)
        page.wait_for_selector("#status[data-status=idle]")
        final = count()
        counters = {c: page.inner_text(f"#{c} b") for c in ("c-preemptions", "c-swaps", "c-cache")}
        spec_shown = page.is_visible("#c-spec") or page.is_visible("#spec-note")
        metrics = scrape(server)
        page.screenshot(path=tmp_path / "dashboard_idle.png")
        # A client that hangs up aborts its request: with nothing else running, no step follows, and the page
        # shows the engine idle all the same.
        body = dict(prompt=prompts[2], max_tokens=150, ignore_eos=True, stream=True)  # (11 blocks: it fits)
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            assert response.status_code == 200
            page.wait_for_selector("#queue-running .req")
            next(response.iter_lines())
        page.wait_for_selector("#status[data-status=idle]")
        aborted = count()
        browser.close()
    print(f"screenshots: {tmp_path}/dashboard.png, dashboard_idle.png")
    assert not errors
    assert seen["running"] >= 3 and seen["swapped"] >= 1 and seen["used"] >= 6
    assert seen["shared"] >= 3 and seen["host"] >= 1 and seen["swap_marker"] >= 1
    # (A request preempted to recompute, when the host pool is full, may hit the cache again when it comes back.)
    hits = [re.fullmatch(r"step \d+⟲(R\d+): (\d+) prompt tokens from the prefix cache", hit) for hit in final["hits"]]
    assert hits[-1].groups() == ("R1", "48")  # P2, the oldest in the list
    for state in (final, aborted):
        assert (state["running"], state["swapped"], state["used"], state["shared"], state["host"]) == (0, 0, 0, 0, 0)
    assert metrics["nanoserve:num_preemptions_total"] >= 1
    assert counters["c-preemptions"] == str(int(metrics["nanoserve:num_preemptions_total"]))
    assert int(counters["c-swaps"]) >= 1
    assert counters["c-cache"].startswith(f"{int(metrics['nanoserve:prefix_cache_hits_total'])} (")
    assert not spec_shown  # (no speculation on this server: nothing of it on the page)


# A sentence the demo model repeats word for word, greedily: n-gram lookup proposes the rest of it, and it passes.
REPEAT = ("Repeat the text below word for word.\n\nText:\nThe KV cache keeps the keys and values of every token a "
          "request has seen, so that each new token reads them instead of computing them again.\n\nRepeated text:\n")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


def read_steps(url: str, steps: list[dict]) -> None:
    """Collect the step records /debug/steps sends, until it has sent nothing for 5 s."""
    with contextlib.suppress(httpx.ReadTimeout), httpx.stream("GET", f"{url}/debug/steps",
                                                              timeout=httpx.Timeout(30, read=5)) as events:
        for line in events.iter_lines():
            if line.startswith('data: {"steps":'):
                steps += json.loads(line.removeprefix("data: "))["steps"]


@needs_browser
def test_page_shows_speculative_tokens(converted, tmp_path):
    """A server started with --speculative-config (n-gram), two requests that repeat a sentence (drafts pass) and
    one story (drafts mostly fail): the cells' drafts bars, each agreeing with its step's records, some green; the
    accepted and rejected drafts in the token bars; the header's count is /metrics'; the legend says it all."""
    playwright = pytest.importorskip("playwright.sync_api", reason="`pip install playwright` to run it")
    url, process = start_server([str(converted[1]), "--dashboard", "--speculative-config", json.dumps(NGRAM),
                                 "--max-model-len", "512", "--uvicorn-log-level", "warning"], tmp_path / "server.log")
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=BROWSER, args=BROWSER_ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 900})
            errors = []
            page.on("pageerror", lambda error: errors.append(error))
            page.goto(f"{url}/dashboard?steps=120")
            page.wait_for_selector("#status[data-status=idle]")
            steps = []  # the records, as the page gets them, until the stream falls silent
            reader = threading.Thread(target=read_steps, args=(url, steps))
            reader.start()
            for prompt in (REPEAT, REPEAT, "Once upon a time"):
                body = dict(prompt=prompt, max_tokens=40, temperature=0)
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
            page.wait_for_selector("#status[data-status=idle]")
            reader.join()
            page.screenshot(path=tmp_path / "dashboard_spec.png")
            bars = page.eval_on_selector_all("#timeline .spec", """gs => gs.map(g => [+g.dataset.seq, +g.dataset.step,
                +g.dataset.accepted, +g.dataset.proposed, g.querySelector("rect + rect").getAttribute("width") /
                g.querySelector("rect").getAttribute("width")])""")
            token_kinds = page.eval_on_selector_all("#timeline .tokens", "rs => rs.map(r => r.dataset.kind)")
            counter = page.inner_text("#c-spec b")
            legend, title = page.inner_text("#timeline-legend"), page.inner_text("#timeline-panel h2")
            browser.close()
        metrics = scrape(Server(url, process, tmp_path / "server.log"))
    finally:
        process.terminate()
        process.wait(30)
    print(f"screenshot: {tmp_path}/dashboard_spec.png")
    assert not errors
    expected = [[b["seq"], s["step"], *b["spec"]] for s in steps for b in s["batch"] if "spec" in b]
    assert [bar[:4] for bar in bars] == expected and len(steps) < 120
    assert all(bar[4] == pytest.approx(bar[2] / bar[3]) for bar in bars)  # the green share is the accepted one
    assert any(accepted == proposed for _, _, accepted, proposed, _ in bars)  # the repeated sentence passes
    assert {"decode", "accepted", "rejected", "prefill"} <= set(token_kinds)
    accepted, drafts = (int(metrics[f"nanoserve:spec_decode_num_{n}_tokens_total"]) for n in ("accepted", "draft"))
    assert counter == f"{accepted}/{drafts} ({round(100 * accepted / drafts)}%)" and 0 < accepted < drafts
    assert "draft tokens accepted" in legend and "draft tokens rejected" in legend and "draft tokens" in title


@contextlib.contextmanager
def page_fed(body: str):
    """The dashboard page in headless Chromium, its step stream a canned `body`: (page, the page's JS errors)."""
    playwright = pytest.importorskip("playwright.sync_api", reason="`pip install playwright` to run it")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=BROWSER, args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 900})
        errors = []
        page.on("pageerror", lambda error: errors.append(error))
        page.route("**/dashboard", lambda route: route.fulfill(body=PAGE.read_text(), content_type="text/html"))
        page.route("**/debug/steps", lambda route: route.fulfill(body=body, content_type="text/event-stream"))
        page.goto("http://nanoserve.test/dashboard")
        yield page, errors
        browser.close()


@needs_browser
def test_page_shows_beams_forking(tiny_models, tmp_path):
    """The page fed the records of a real beam search (two requests, 3 beams each; the server has no beam search
    yet, so Playwright serves the page and one recorded stream, and nothing goes to the network): a fork line for
    each fork, a square for each dropped beam, each request's beams in rows of their own, the steps' beam events,
    the legend, and the block grid mid-search: the blocks the beams share, numbered with their ref counts."""
    llm, stream, states = engine_with_stream(tiny_models["qwen3"], num_kvcache_blocks=32, enable_beam_search=True)
    llm.beam_search([[5, 6, 7, 8, 9, 10], [11, 12, 13]], BeamSearchParams(beam_width=3, max_tokens=6),
                    use_tqdm=False)
    steps = records(stream)
    shown = next(i for i, state in enumerate(states) if i >= 3 and any(ref > 1 for ref, _, _ in state["blocks"]))
    steps = steps[: shown + 1]  # the search as the page saw it after step `shown`, its beams still running
    body = event("config", page_config(llm.engine.config, "tiny")) + "retry: 600000\n\n" + event(
        "steps", dict(steps=steps, dropped=0, engine=states[shown]))
    with page_fed(body) as (page, errors):
        page.wait_for_selector("#timeline .fork")
        page.screenshot(path=tmp_path / "dashboard_beams.png")
        forks = page.eval_on_selector_all("#timeline .fork", "gs => gs.map(g => [+g.dataset.seq, +g.dataset.parent])")
        drops = page.eval_on_selector_all("#timeline .marker[data-event=dropped]", "ms => ms.map(m => +m.dataset.seq)")
        rows = page.eval_on_selector_all("#timeline text[font-weight=bold]", "ts => ts.map(t => t.textContent)")
        beam_events = page.eval_on_selector_all("#events .event[data-kind=beams]", "es => es.map(e => e.textContent)")
        legend = page.inner_text("#timeline-legend")
        shared = page.eval_on_selector_all("#kv-grid .block[data-state=shared]", "bs => bs.map(b => b.textContent)")
    print(f"screenshot: {tmp_path}/dashboard_beams.png")
    assert not errors
    assert forks == [list(pair) for s in steps for pair in s["forked"]] and len(forks) >= 6
    assert drops == [seq for s in steps for seq in s["dropped"]] and drops
    root = {b["seq"]: b["seq"] for b in steps[0]["batch"]}  # each beam's request: its first beam, the prompt's
    for child, parent in forks:
        root[child] = root[parent]
    order = [root[int(row.removeprefix("R"))] for row in rows]
    assert order == sorted(order) and len(set(order)) == 2  # each request's beams together
    assert len(beam_events) == sum(bool(s["forked"] or s["dropped"]) for s in steps[-12:])
    assert all(re.fullmatch(r"step \d+●beams: .*(forked \(sharing its blocks\)|dropped \(blocks freed\))", e)
               for e in beam_events)
    assert "a beam forks" in legend and "a beam is dropped" in legend
    assert shared == [str(ref) for ref, _, _ in states[shown]["blocks"] if ref > 1] and shared


@needs_browser
def test_page_tags_lora_rows(tiny_models, tmp_path):
    """Each row computed with a LoRA adapter carries its name; the page draws the adapter's stripe on those cells
    only, and its legend names the adapter."""
    adapter = make_adapter(tiny_models["qwen3"], tmp_path / "style", 1, r=4, lora_alpha=8, target_modules=["q_proj"])
    llm, stream, states = engine_with_stream(tiny_models["qwen3"], enable_lora=True, num_kvcache_blocks=32)
    llm.generate([[5, 6, 7], [8, 9, 10]], GREEDY, use_tqdm=False, lora_request=[None, LoRARequest("style", 1, adapter)])
    steps = records(stream)
    assert [[b.get("lora") for b in s["batch"]] for s in steps] == [[None, "style"]] * len(steps)
    body = event("config", page_config(llm.engine.config, "tiny")) + "retry: 600000\n\n" + event(
        "steps", dict(steps=steps, dropped=0, engine=states[-1]))
    with page_fed(body) as (page, errors):
        page.wait_for_selector("#timeline rect.lora")
        page.screenshot(path=tmp_path / "dashboard_lora.png")
        stripes = page.eval_on_selector_all("#timeline rect.lora", "rs => rs.map(r => [+r.dataset.seq, r.dataset.lora, "
                                            "r.getAttribute('fill')])")
        legend = page.inner_text("#timeline-legend")
    print(f"screenshot: {tmp_path}/dashboard_lora.png")
    assert not errors
    seq = steps[0]["batch"][1]["seq"]
    assert stripes == [[seq, "style", LORA_COLOURS[0]]] * len(steps) and "LoRA adapter style" in legend


def test_sigterm_ends_the_stream_at_once(server):
    """The last test: a browser's stream does not hold the server up for its --shutdown-timeout (60 s here: far
    above what a loaded machine takes to stop, so the bound below tells a held-up stream apart; a second or so idle)."""
    with httpx.stream("GET", f"{server.url}/debug/steps", headers=AUTH, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: config"
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for _ in lines:  # until the server ends the stream
            pass
    assert server.process.wait(90) == 0 and time.monotonic() - start < 30, server.log.read_text()
    assert "Traceback" not in server.log.read_text()


@needs_browser
def test_page_opened_late_on_a_large_pool(tiny_models, tmp_path):
    """A page opened after the engine's steps left its window, on 2,912 blocks (the default pool of the demo model
    on 2 cores): the budget and the counters come from the config and the stats, not from steps it never saw, the
    events panel says what the counters counted before it, and the pool is drawn a cell for each 6 blocks, each
    cell counting exactly the blocks it stands for (served by Playwright, as above)."""
    llm, stream, states = engine_with_stream(tiny_models["qwen3"], num_kvcache_blocks=2912)
    system = list(range(100, 140))  # 10 full blocks: the later prompts find them in the prefix cache
    llm.generate([system + [7, 8]], GREEDY, use_tqdm=False)
    llm.generate([system + [300 + i, 9] for i in range(3)] + [[400 + i for i in range(30)]], GREEDY, use_tqdm=False)
    state = next(s for s in states if any(ref > 1 for ref, _, _ in s["blocks"]) and s["stats"]["num_cached_tokens"])
    config = page_config(llm.engine.config, "tiny")
    body = event("config", config) + "retry: 600000\n\n" + event("steps", dict(steps=[], dropped=0, engine=state))
    with page_fed(body) as (page, errors):
        page.wait_for_selector("#kv-grid .block[data-state=group]")
        page.screenshot(path=tmp_path / "dashboard_large_pool.png")
        cells = page.eval_on_selector_all("#kv-grid .block", "cs => cs.map(c => JSON.parse(c.dataset.counts))")
        title, timeline = page.inner_text("#kv-title"), page.text_content("#timeline")
        steps, events = page.inner_text("#c-step b"), page.inner_text("#events")
    print(f"screenshot: {tmp_path}/dashboard_large_pool.png")
    assert not errors
    assert len(cells) == 486 and "a cell for each 6" in title  # ceil(2912 / 512) = 6 blocks a cell
    for c, counts in enumerate(cells):
        group = state["blocks"][6 * c : 6 * c + 6]
        assert counts == {"shared": sum(ref > 1 for ref, _, _ in group), "used": sum(ref == 1 for ref, _, _ in group),
                          "cached": sum(ref == 0 and cached for ref, cached, _ in group),
                          "free": sum(ref == 0 and not cached for ref, cached, _ in group)}, c
    assert sum(counts["shared"] for counts in cells) > 0
    assert f"the budget, {config['max_num_batched_tokens']} tokens a step" in timeline and "budget 1" not in timeline
    assert steps == str(state["stats"]["num_steps"])
    assert events == ("none in the steps shown; since the server started: "
                      f"{state['stats']['num_cached_tokens']} prompt tokens from the prefix cache")


@needs_browser
def test_page_shows_the_host_tier(tiny_models, tmp_path):
    """With kv_offloading_size, the KV panel draws the prefix cache's host tier beside the device pool: how many of
    its blocks hold evicted cached KV, filled in proportion, and its hits; without one, nothing (served by
    Playwright, as above)."""
    host_tier = 40 * 2048 / 2**30  # GiB: 40 blocks of 4 tokens of the tiny model (K and V, 2 layers, 2 x 16 floats)
    llm, stream, states = engine_with_stream(tiny_models["qwen3"], num_kvcache_blocks=12, kv_offloading_size=host_tier)
    prompts = [[100 + 40 * i + j for j in range(25)] for i in range(3)]  # 6 full blocks each: 12 hold two
    for _ in range(2):  # the second round finds the evicted blocks on the host
        for prompt in prompts:
            llm.generate([prompt], GREEDY, use_tqdm=False)
    state, stats, tier = states[-1], llm.stats, llm.engine.host_tier
    assert state["host_tier"] == dict(cached=len(tier.cached), num_blocks=tier.num_blocks)
    assert tier.num_blocks == 40 and 0 < len(tier.cached) < 40 and stats.num_host_cached_tokens > 0
    body = event("config", page_config(llm.engine.config, "tiny")) + "retry: 600000\n\n" + event(
        "steps", dict(steps=records(stream), dropped=0, engine=state))
    with page_fed(body) as (page, errors):
        page.wait_for_selector("#tier-part:not([hidden])")
        page.screenshot(path=tmp_path / "dashboard_host_tier.png")
        title = page.inner_text("#tier-title")
        filled = page.evaluate("() => $('tier-meter').firstElementChild.offsetWidth / $('tier-meter').clientWidth")
        page.evaluate("() => { engine = {...engine, host_tier: null}; render(); }")  # a page on an engine without
        off = page.is_hidden("#tier-part")
    print(f"screenshot: {tmp_path}/dashboard_host_tier.png")
    assert not errors
    assert title == (f"{len(tier.cached)} of {tier.num_blocks} blocks hold evicted cached KV · host hits: "
                     f"{stats.num_host_cached_tokens} prompt tokens ({stats.num_loaded_blocks} blocks copied back)")
    assert filled == pytest.approx(len(tier.cached) / tier.num_blocks, abs=0.01) and off
    assert StepStream(LLM(tiny_models["qwen3"], num_kvcache_blocks=16).engine).read_engine()["host_tier"] is None


def windowed_engine(tmp_path) -> LLM:
    """A tiny Mistral, every layer windowed (24 tokens), in 8 blocks of 16 (7 and the null block)."""
    from test_sliding_window import NO_EOS, save_model
    from transformers import MistralConfig

    path = save_model(tmp_path / "mistral", MistralConfig(**NO_EOS, sliding_window=24, tie_word_embeddings=False))
    return LLM(path, block_size=16, num_kvcache_blocks=8)


def test_a_request_refused_as_never_fitting_reaches_the_stream(tmp_path):
    """sliding_window/ refuses a request that could never fit at add_request, in the caller's thread, no step
    made: the next event brings its reason anyway, though the engine stays idle; only once."""
    llm = windowed_engine(tmp_path)
    stream = StepStream(llm.engine, interval=0.05)
    stream.engine = stream.read_engine()

    async def read() -> list[dict]:
        stopping, batches = asyncio.Event(), []
        async for text in stream_steps(stream, {"model": "m"}, stopping):
            if text.startswith("event: config"):
                with pytest.raises(ValueError, match="never fits") as error:
                    llm.engine.add_request("long", list(range(3, 43)), SamplingParams(max_tokens=600))
                reason = str(error.value)
                continue
            batches.append(json.loads(text.split("\ndata: ")[1]))
            if batches[-1]["refused"]["num"]:
                await asyncio.sleep(0.2)  # (later ticks send nothing new)
                stopping.set()
        return batches, reason

    batches, reason = asyncio.run(asyncio.wait_for(read(), 30))
    assert "sliding_window 24" in reason and "the pool has 7" in reason
    assert [b["refused"] for b in batches if b["refused"]["num"]] == [dict(num=1, reasons=[reason])]
    assert not llm.engine.scheduler.running and all(b["steps"] == [] for b in batches)


@needs_browser
def test_page_lists_a_request_refused_as_never_fitting(tmp_path):
    """The page, fed the refusal: an event "on add" with the refusal's reason, once."""
    llm = windowed_engine(tmp_path)
    with pytest.raises(ValueError) as error:
        llm.engine.add_request("long", list(range(3, 43)), SamplingParams(max_tokens=600))
    stream = StepStream(llm.engine)
    refused = dict(num=1, reasons=[str(error.value)])
    body = event("config", page_config(llm.engine.config, "tiny")) + "retry: 600000\n\n" + "".join(
        event("steps", dict(steps=[], dropped=0, engine=stream.read_engine() if i == 0 else None, refused=refused))
        for i in range(2))
    with page_fed(body) as (page, errors):
        page.wait_for_selector("#events .event[data-kind=refused]")
        page.screenshot(path=tmp_path / "dashboard_refused.png")
        shown = page.eval_on_selector_all("#events .event[data-kind=refused]", "es => es.map(e => e.textContent)")
    print(f"screenshot: {tmp_path}/dashboard_refused.png")
    assert not errors
    assert shown == [f"on add⊘a request refused as never fitting: {error.value}"]
