"""What 2026 apps send to a server: OpenAI's Responses API (serving/responses.py), `parallel_tool_calls`, and vLLM's
utility routes (serving/tokenization.py), through the official `openai` client and httpx; and a fuzzer driven by
the server's own OpenAPI schema, which must never get a 5xx.

One server for the module (conftest's demo model), as in tests/test_serving.py. Greedy Responses answers are
compared with the chat route's on the same messages.
"""
import json
import os

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Server, start_server

API_KEY = "sk-test-responses"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2"
MAX_MODEL_LEN = 512
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(temperature=0)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}
ADD = {"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}


def chat_tool(tool: dict) -> dict:
    """A Responses function tool (flat) as chat's ({"type": "function", "function": {...}})."""
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    flags = ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--cpu-kvcache-space", "0.25",
             "--uvicorn-log-level", "warning", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    url, process = start_server([str(converted[1]), *flags], log, {**os.environ, "NANOSERVE_API_KEY": API_KEY})
    yield Server(url, process, log)
    process.terminate()
    process.wait(30)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat_text(client, messages, **body) -> tuple[str, object]:
    response = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY, **body)
    return response.choices[0].message.content, response


# ---- the Responses API ---------------------------------------------------------------------------------
def test_responses_equal_chat(client):
    """Greedy, the same messages: responses.create's output_text is the chat's text, whole and streamed; usage
    counts the same tokens; `instructions` is a system message; a string input is one user message."""
    expected, chat = chat_text(client, QUESTION, max_tokens=24)
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, **GREEDY)
    assert response.object == "response" and response.status == "completed" and response.incomplete_details is None
    assert response.output_text == expected
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    text = QUESTION[0]["content"]
    assert client.responses.create(model=MODEL, input=text, max_output_tokens=24, **GREEDY).output_text == expected
    system = "Answer in French."
    expected, _ = chat_text(client, [{"role": "system", "content": system}, *QUESTION], max_tokens=24)
    response = client.responses.create(model=MODEL, instructions=system, input=text, max_output_tokens=24, **GREEDY)
    assert response.output_text == expected and response.instructions == system


def test_streamed_responses_follow_the_event_sequence(client):
    """The stream helper accumulates the events into the final response; the events come in the Responses
    order, the deltas joining to output_text.done's text, and response.completed carries usage."""
    expected, chat = chat_text(client, QUESTION, max_tokens=24)
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=24, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == expected and final.status == "completed"
    assert final.usage.output_tokens == chat.usage.completion_tokens
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert "".join(e.delta for e in deltas) == expected == events[-4].text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.item_id for e in deltas}) == 1 and deltas[0].item_id == final.output[0].id
    # the raw stream, as responses.create(stream=True) gives it
    raw = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, stream=True, **GREEDY))
    assert [e.type for e in raw] == kinds and raw[-1].response.output_text == expected


def test_cut_off_responses_are_incomplete(client):
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, **GREEDY)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=3, **GREEDY) as stream:
        final = stream.get_final_response()
    assert (final.status, final.incomplete_details.reason, final.output_text) == \
        ("incomplete", "max_output_tokens", response.output_text)


def check_calls(output, names: set[str]) -> list[tuple[str, dict]]:
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, ADD)}
    assert output and all(item.type == "function_call" for item in output)
    for item in output:
        assert item.name in names and item.call_id.startswith("call_") and item.status == "completed"
        jsonschema.validate(json.loads(item.arguments), schemas[item.name])
    return [(item.name, json.loads(item.arguments)) for item in output]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_tools_come_back_as_function_call_items(client, tool_choice):
    """Whole and streamed, the same calls; their arguments validate against the tool's schema; the chat route
    gives the same calls for the same tools."""
    pytest.importorskip("xgrammar")
    body = dict(model=MODEL, input=QUESTION, tools=[WEATHER, ADD], tool_choice=tool_choice, max_output_tokens=120,
                **GREEDY)
    response = client.responses.create(**body)
    calls = check_calls(response.output, {"get_weather", "add"})
    assert response.status == "completed" and response.output_text == ""
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert check_calls(final.output, {"get_weather", "add"}) == calls
    for index, item in enumerate(final.output):  # the argument deltas join to each call's arguments
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.output_index == index]
        assert "".join(deltas) == item.arguments
    chat_choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice != "required" else \
        "required"
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[chat_tool(WEATHER), chat_tool(ADD)],
                                          tool_choice=chat_choice, max_tokens=120, **GREEDY)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls] == calls


def test_function_call_outputs_in_the_input(client):
    """An agent's second turn: the call the model made and its result go back as input items; the answer is the
    chat route's for the same history (assistant tool_calls, then a tool message)."""
    arguments = '{"city": "Paris", "unit": "C"}'
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    expected, _ = chat_text(client, history, tools=[chat_tool(WEATHER)], tool_choice="none", max_tokens=24)
    items = [*QUESTION, {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees, sunny"}]
    response = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none",
                                       max_output_tokens=24, **GREEDY)
    assert response.output_text == expected
    # an earlier answer's output items, sent back as they came (ids, status, annotations), change nothing
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, **GREEDY)
    follow_up = {"role": "user", "content": "And of Italy?"}
    expected, _ = chat_text(client, [*QUESTION, {"role": "assistant", "content": first.output_text}, follow_up],
                            max_tokens=16)
    items = [*QUESTION, *[item.model_dump(exclude_none=True) for item in first.output], follow_up]
    assert client.responses.create(model=MODEL, input=items, max_output_tokens=16, **GREEDY).output_text == expected


def test_text_format_json_schema_and_json_object(client):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    schema = WEATHER["parameters"]
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=60, **GREEDY, text={
        "format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=60, **GREEDY,
                                       text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(response.output_text), dict)


# ---- parallel_tool_calls -------------------------------------------------------------------------------
TWO_PLUS_TWO = [{"role": "user", "content": "What is 2+2?"}]  # greedy, the demo model calls add over and over


def test_parallel_tool_calls_false_gives_one_call(client):
    """With tool_choice "required", greedy: the grammar allows one call, so the client gets exactly one, and
    finish_reason "tool_calls", where the default (parallel calls) repeats the call until max_tokens."""
    pytest.importorskip("xgrammar")
    body = dict(model=MODEL, messages=TWO_PLUS_TWO, tools=[chat_tool(ADD)], tool_choice="required", max_tokens=150,
                **GREEDY)
    choice = client.chat.completions.create(**body, parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    (call,) = choice.message.tool_calls
    streamed = list(client.chat.completions.create(**body, parallel_tool_calls=False, stream=True))
    deltas = [d for chunk in streamed for d in chunk.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0} and streamed[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    response = client.responses.create(model=MODEL, input=TWO_PLUS_TWO, tools=[ADD], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=150, **GREEDY)
    assert check_calls(response.output, {"add"}) == [("add", json.loads(call.function.arguments))]


def test_parallel_tool_calls_false_keeps_the_first_auto_call(client):
    """"auto": the output is free, so the parser's first call is the one returned, whole and streamed."""
    pytest.importorskip("xgrammar")
    call = '<tool_call>\\n\\{"name": "add", "arguments": \\{"a": [1-9], "b": [1-9]\\}\\}\\n</tool_call>'
    body = dict(model=MODEL, messages=TWO_PLUS_TWO, tools=[chat_tool(ADD)], max_tokens=200, **GREEDY,
                extra_body={"structured_outputs": {"regex": f"{call}\\n{call}"}})
    both = client.chat.completions.create(**body).choices[0].message.tool_calls
    one = client.chat.completions.create(**body, parallel_tool_calls=False).choices[0]
    assert len(both) == 2 and [c.function for c in one.message.tool_calls] == [both[0].function]
    assert one.finish_reason == "tool_calls"
    streamed = list(client.chat.completions.create(**body, parallel_tool_calls=False, stream=True))
    assert {d.index for chunk in streamed for d in chunk.choices[0].delta.tool_calls or []} == {0}


# ---- utility routes ------------------------------------------------------------------------------------
def test_tokenize_then_detokenize_round_trips(server, client):
    text = "The capital of France is Paris. ¿Qué tal? 東京"
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    body = tokens.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": text}
    # chat messages are rendered by the template exactly as a chat request's prompt
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}).json()
    assert tokens["count"] == chat.usage.prompt_tokens
    without = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION, "add_generation_prompt": False}).json()
    assert tokens["tokens"][: without["count"]] == without["tokens"] and without["count"] < tokens["count"]


def test_version_and_tokenizer_info(server):
    from importlib.metadata import version

    assert httpx.get(f"{server.url}/version").json() == {"version": version("nanoserve")}
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["tokenizer_class"] and "{% for message in messages %}" in info["chat_template"]
    assert info["eos_token"] == "<|im_end|>"


BAD_REQUESTS = [  # (route, body, param): each a 400 in OpenAI's shape that names the field
    ("/v1/responses", {"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),  # an unknown item type
    ("/v1/responses", {"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses", {"input": "Hi", "store": True}, "store"),
    ("/v1/responses", {"input": 5}, "input"),
    ("/v1/responses", {"input": [{"role": "user", "content": 5}]}, "input"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens"),
    ("/v1/responses", {"input": "Hi", "temperature": -1}, "temperature"),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),  # built-in tools
    ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "low"}}, "reasoning"),  # not declared: not dropped
    ("/v1/responses", {"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input"),
    ("/v1/responses", {"model": "gpt-5", "input": "Hi"}, "model"),
    ("/v1/chat/completions", {"messages": QUESTION, "logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": QUESTION, "parallel_tool_calls": "sometimes"}, "parallel_tool_calls"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "!"}, "suffix"),
    ("/tokenize", {"prompt": "Hi", "messages": QUESTION}, "prompt"),
    ("/tokenize", {"prompt": "Hi", "add_generation_prompt": False}, "add_generation_prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "Hi"}, "tokens"),
]


@pytest.mark.parametrize("route, body, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, route, body, param):
    response = httpx.post(f"{server.url}{route}", json={"model": MODEL, **body}, headers=AUTH, timeout=30)
    assert response.status_code == (404 if param == "model" else 400), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert error["message"].startswith(param) or param == "model", error


# ---- the OpenAPI fuzzer --------------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens")  # kept small: the fuzzer is not a benchmark


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values that fit a JSON schema of FastAPI's OpenAPI document (pydantic's: $ref, anyOf/oneOf, const, enum,
    objects, arrays, scalars with their bounds)."""
    if depth > 8:
        return st.none()
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[-1]], components, depth + 1)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, components, depth + 1) for s in schema[key]])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:  # the required fields and up to 3 others (more would
        fields = {name: from_schema(s, components, depth + 1) for name, s in schema["properties"].items()}
        required = [name for name in fields if name in schema.get("required", [])]  # rarely all fit together)
        chosen = st.lists(st.sampled_from([name for name in fields if name not in required] or [""]), max_size=3,
                          unique=True).map(lambda names: [n for n in names if n])
        return chosen.flatmap(lambda names: st.fixed_dictionaries({n: fields[n] for n in required + names}))
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components, depth + 1),
                        min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
    scalars = {"string": st.text(max_size=12), "boolean": st.booleans(), "null": st.none(),
               "integer": st.integers(schema.get("minimum"), schema.get("maximum")) | st.sampled_from([-1, 0, 2 ** 40]),
               "number": st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False,
                                   allow_infinity=False)}
    return scalars.get(kind, JSON)


@st.composite
def bodies(draw, schema: dict, components: dict):
    """A body that fits the schema, or one broken in one place: a field of another type, a required field
    missing, an unknown field; generation kept to a few tokens."""
    body = draw(from_schema(schema, components))
    how = draw(st.sampled_from(["fits", "fits", "fits", "retyped", "missing", "unknown"]))
    if isinstance(body, dict) and "model" in body:  # mostly the served model: the rest is a 404
        body["model"] = draw(st.sampled_from([MODEL, MODEL, MODEL, body["model"]]))
    if isinstance(body, dict) and body and how in ("retyped", "missing"):
        name = draw(st.sampled_from(sorted(body)))
        if how == "missing":
            del body[name]
        else:
            body[name] = draw(JSON)
    elif isinstance(body, dict) and how == "unknown":
        body[draw(st.text(min_size=1, max_size=8))] = draw(JSON)
    if isinstance(body, dict):
        for name in ("n", "best_of", *LENGTHS):
            if isinstance(body.get(name), int) and body[name] > 2:
                body[name] = 2
        length = next((name for name in LENGTHS if name in schema_properties(schema, components)), None)
        if length and length not in body:  # (else up to max_model_len)
            body[length] = draw(st.integers(1, 2))
    return body


def schema_properties(schema: dict, components: dict) -> dict:
    if "$ref" in schema:
        return components[schema["$ref"].rsplit("/", 1)[-1]].get("properties", {})
    return schema.get("properties", {})


def test_openapi_fuzzer_finds_no_5xx(server):
    """Every POST route of the server's own OpenAPI schema, fed bodies generated from that schema (fitting, or
    broken in one place): each answer is below 500, a 200 fits the route's response schema, and the server's GET
    routes answer 200."""
    jsonschema = pytest.importorskip("jsonschema")
    document = httpx.get(f"{server.url}/openapi.json").json()
    components = document["components"]["schemas"]
    routes = {path: op["post"]["requestBody"]["content"]["application/json"]["schema"]
              for path, op in document["paths"].items() if "post" in op and "requestBody" in op["post"]}
    answers = {path: {**document["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"],
                      "components": document["components"]} for path in routes}  # (its $refs resolve there)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"} <= set(routes)
    assert all(answers[path]["$ref"] for path in ("/v1/responses", "/tokenize", "/detokenize"))  # their shapes
    for path, op in document["paths"].items():
        if "get" in op and path not in ("/debug/steps",):
            assert httpx.get(f"{server.url}{path}", headers=AUTH, timeout=30).status_code == 200, path
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def fuzz(path, data):
        body = data.draw(bodies(routes[path], components))
        response = http.post(path, json=body)
        assert response.status_code < 500, (path, body, response.text)
        if isinstance(body, dict) and body.get("stream") is True and response.status_code == 200:
            assert '"server_error"' not in response.text, (path, body, response.text)
        elif response.status_code == 200:
            jsonschema.validate(response.json(), answers[path])

    for path in sorted(routes):
        fuzz(path)
