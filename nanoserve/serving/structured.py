"""Structured outputs and tool calls at the server: what OpenAI clients send, turned into the
engine's `StructuredOutputsParams`, and the constrained text turned back into OpenAI's `tool_calls`.

- `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"schema": ...}}, and vLLM's `structured_outputs` extension object ({"json": ...} |
  {"regex": ...} | {"choice": [...]} | {"grammar": ...}).
- `tools` with `tool_choice` "required": the output is constrained to a JSON list of
  {"name", "parameters"}, one of the tools' argument schemas each; a named function: to that
  function's argument schema alone.
- `tool_choice` "auto" (the server started with --enable-auto-tool-choice --tool-call-parser
  hermes): the output is free; the hermes parser takes each
  <tool_call>{"name": ..., "arguments": {...}}</tool_call> out of the text.
- `parallel_tool_calls: false`: at most one call. "required" constrains the list to one item (a
  named function is one call anyway); under "auto" the output is free, so only the first call found
  is returned.
Streamed, the calls come as deltas (serving/tool_stream.py); calls in the chat history:
serving/tool_messages.py.
"""
import json
import re
import uuid

from nanoserve.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    Response,
    SamplingRequest,
    ToolCall,
)
from nanoserve.structured_outputs import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
HERMES_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def structured_outputs_params(request: SamplingRequest, tool_call_parser: str | None
                              ) -> StructuredOutputsParams | None:
    """The request's constraint, if any. A bad one is a 400 whose `param` names the field it came
    from."""
    chosen = [name for name in ("structured_outputs", "response_format")
              if getattr(request, name) is not None]
    mode = tool_mode(request, tool_call_parser)
    if mode in ("required", "named"):
        chosen.append("tool_choice")
    if len(chosen) > 1:
        raise APIError(400, f"{chosen[1]}: cannot be combined with {chosen[0]}", chosen[1])
    if not chosen:
        return None
    field = chosen[0]
    try:
        if field == "structured_outputs":
            return StructuredOutputsParams(**request.structured_outputs)
        if field == "response_format":
            return response_format_params(request.response_format)
        return StructuredOutputsParams(json=tools_schema(request))
    except (TypeError, ValueError) as e:  # TypeError: an unknown key in structured_outputs
        # The spec's checks name its own fields ("structured_outputs.json: ..."): say where the
        # client wrote it.
        where = {"response_format": "response_format.json_schema.schema",
                 "tool_choice": "tools.function.parameters"}
        message, param = str(e), field.replace("tool_choice", "tools")
        if field in where:
            message = re.sub(r"^structured_outputs\.\w+", where[field], message)
        if not message.startswith(param):
            message = f"{field}: {message}"
        raise APIError(400, message, param) from e


def response_format_params(response_format: dict) -> StructuredOutputsParams | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ValueError("json_schema.schema: missing")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def tool_mode(request: SamplingRequest, tool_call_parser: str | None) -> str | None:
    """None (no tools, or tool_choice "none"), "required", "named" or "auto"."""
    tools = getattr(request, "tools", None)
    choice = getattr(request, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: needs tools", "tool_choice")
        return None
    choice = choice or "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in {t.function.name for t in tools}:
            raise APIError(400, f"tool_choice: no tool named {name!r} in tools", "tool_choice")
        return "named"
    if choice == "auto" and tool_call_parser is None:
        raise APIError(400, 'tool_choice: "auto" needs the server started with '
                       "--enable-auto-tool-choice --tool-call-parser hermes", "tool_choice")
    if choice not in ("none", "auto", "required"):
        raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or a named function, "
                       f"got {choice!r}", "tool_choice")
    return None if choice == "none" else choice


def tools_schema(request: ChatCompletionRequest) -> dict:
    """A named function: its arguments' schema. "required": a list of one or more calls, each a
    tool's name and arguments matching that tool's schema."""
    if isinstance(request.tool_choice, dict):
        name = request.tool_choice["function"]["name"]
        return next(t.function.parameters for t in request.tools if t.function.name == name)
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name},
                             "parameters": t.function.parameters},
              "required": ["name", "parameters"]} for t in request.tools]
    # else a greedy model may repeat a call forever
    one_call = {} if request.parallel_tool_calls else {"maxItems": 1}
    return {"type": "array", "minItems": 1, **one_call, "items": {"anyOf": calls}}


def with_tool_calls(response: Response, request: ChatCompletionRequest,
                    tool_call_parser: str | None) -> Response:
    """Rewrite each choice's text as OpenAI's tool_calls (finish_reason "tool_calls") when the
    request's tool mode made (required, named) or found (auto) calls in it; text that holds none
    stays as it is."""
    mode = tool_mode(request, tool_call_parser)
    if mode is None:
        return response
    for choice in response.choices:
        text = choice.message.content or ""
        if mode == "auto":
            calls, content = parse_hermes(text)
            calls = calls if request.parallel_tool_calls else calls[:1]
        elif choice.finish_reason != "stop":
            # cut off by max_tokens: no whole call to return; the text stays
            continue
        elif mode == "named":
            calls, content = [(request.tool_choice["function"]["name"], json.loads(text))], None
        else:
            calls, content = [(c["name"], c["parameters"]) for c in json.loads(text)], None
        if calls:
            choice.message.tool_calls = [
                ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                         function={"name": name, "arguments": json.dumps(arguments)})
                for name, arguments in calls]
            choice.message.content = content
            choice.finish_reason = "tool_calls"
    return response


def parse_hermes(text: str) -> tuple[list[tuple[str, dict]], str | None]:
    """Hermes' format (Qwen's and others' chat templates): each call a JSON object between
    <tool_call> tags. The calls that parse, and the text before the first tag (None if empty); a
    malformed call leaves the text as is."""
    calls = []
    for body in HERMES_TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            calls.append((call["name"], call.get("arguments", {})))
        except (json.JSONDecodeError, KeyError, TypeError):
            return [], text
    return calls, text.split("<tool_call>", 1)[0].strip() or None

