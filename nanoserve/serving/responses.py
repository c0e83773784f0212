"""OpenAI's Responses API, `POST /v1/responses`: what `client.responses.create(...)` and the OpenAI
Agents SDK send, answered by the chat route.

A Responses request is a chat request in other words (`as_chat`): `instructions` becomes a system
message and `input` (a string, or a list of items: messages, the function calls the model made, and
their outputs) the chat's messages; `max_output_tokens`, `text.format`, the flat function `tools`
({"type": "function", "name", ...}) and `tool_choice` ({"type": "function", "name"}) become
`max_completion_tokens`, `response_format`, chat's tools and tool choice. The chat route generates;
its answer becomes this API's shape (`output_items`, `finished`): `output` holds a message item with
the text as `output_text` and/or a `function_call` item per call; `status` is "completed", or
"incomplete" with `incomplete_details.reason` "max_output_tokens"; `usage` counts input and output
tokens. Streamed, its chunks become the Responses events (`ResponseEvents`).
Nothing is stored: `store: true` and `previous_response_id` are a 400 that says to send the whole
conversation. The request and response models are in serving/responses_protocol.py; any field not
declared there (built-in tools, `reasoning`, `include`, ...) is a 400 naming it.
"""
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from nanoserve.serving.answers import Chunks
from nanoserve.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    DeltaMessage,
    Response,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from nanoserve.serving.responses_protocol import (
    FunctionCall,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    NamedTool,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormat,
)


# ---- from Responses to chat and back -------------------------------------------------------------
def refuse_stored_state(request: ResponsesRequest) -> None:
    if request.previous_response_id is not None:
        raise APIError(400, "previous_response_id: nanoserve stores no responses; send the whole "
                       "conversation as input (the earlier output items, then the new message)",
                       "previous_response_id")
    if request.store:
        raise APIError(400, "store: nanoserve stores no responses; leave it unset or false",
                       "store")


def input_messages(request: ResponsesRequest) -> list[ChatMessage]:
    """instructions and input as chat messages: consecutive function_call items are one assistant
    message with their tool_calls, each function_call_output a tool message
    (serving/tool_messages.py checks them)."""
    messages = []
    if request.instructions:
        messages.append(ChatMessage(role="system", content=request.instructions))
    items = request.input
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            text = item.content
            if not isinstance(text, str):
                text = "".join(p.text for p in text)
            messages.append(ChatMessage(role="system" if item.role == "developer" else item.role,
                                        content=text))
        elif isinstance(item, FunctionCallItem):
            try:
                arguments = json.loads(item.arguments)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise APIError(400, f"input[{i}].arguments: must be a JSON object, got "
                               f"{item.arguments[:40]!r}", "input")
            call = ToolCall(id=item.call_id,
                            function={"name": item.name, "arguments": item.arguments})
            if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
                messages[-1].tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif not any(isinstance(x, FunctionCallItem) and x.call_id == item.call_id
                     for x in items[:i]):
            raise APIError(400, f"input[{i}].call_id: {item.call_id!r} answers no function_call "
                           "item before it", "input")
        else:
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=item.output))
    return messages


def as_chat(request: ResponsesRequest) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             for t in request.tools or []]
    choice = request.tool_choice
    if isinstance(choice, NamedTool):
        choice = {"type": "function", "function": {"name": choice.name}}
    response_format, f = None, request.text and request.text.format
    if f and f.type == "json_schema":
        if f.schema_ is None:
            raise APIError(400, "text.format.schema: json_schema needs a schema", "text")
        response_format = {"type": f.type, "json_schema": {"name": f.name, "schema": f.schema_}}
    elif f:
        response_format = {"type": f.type}
    messages = input_messages(request)
    if not messages:
        raise APIError(400, "input: nothing to answer (no items, no instructions)", "input")
    temperature = 1.0 if request.temperature is None else request.temperature  # (OpenAI's defaults)
    top_p = 1.0 if request.top_p is None else request.top_p
    return ChatCompletionRequest(
        model=request.model, messages=messages, tools=tools or None, tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls,
        max_completion_tokens=request.max_output_tokens, temperature=temperature, top_p=top_p,
        response_format=response_format, stream=request.stream,
        # (response.completed's usage)
        stream_options={"include_usage": True} if request.stream else None)


# The chat route's errors name chat's fields: the client wrote this API's.
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens",
           "response_format.json_schema.schema": "text.format.schema",
           "response_format": "text.format", "tools.function.parameters": "tools.parameters"}


def renamed(e: APIError) -> APIError:
    old = next((name for name in RENAMED if e.message.startswith(name)), None)
    message = RENAMED[old] + e.message[len(old):] if old else e.message
    params = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
    param = params.get(e.param, e.param)
    return APIError(e.status_code, message, param, e.code, e.type)


def output_items(message: DeltaMessage, status: str) -> list[OutputMessage | FunctionCall]:
    """The chat answer's message as output items: its text, then its tool calls."""
    items = [OutputMessage(id=f"msg_{uuid.uuid4().hex}", status=status,
                           content=[OutputText(text=message.content)])] \
        if message.content else []
    return items + [FunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=c.id, name=c.function.name,
                                 arguments=c.function.arguments, status="completed")
                    for c in message.tool_calls or []]


def finished(head: ResponseObject, output: list, finish_reason: str | None,
             usage: Usage) -> ResponseObject:
    # max_output_tokens, or max_model_len (the default max_output_tokens)
    incomplete = finish_reason == "length"
    return head.model_copy(update=dict(
        status="incomplete" if incomplete else "completed", output=output,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                            total_tokens=usage.total_tokens,
                            input_tokens_details=InputTokensDetails(
                                cached_tokens=usage.prompt_tokens_details.cached_tokens))))


# ---- streamed ------------------------------------------------------------------------------------
class ResponseEvents:
    """The chat chunks as the Responses events, in the order the SDK's stream helper accumulates
    them: response.created, response.in_progress; per output item output_item.added, its content
    (for a message content_part.added, output_text.delta..., output_text.done, content_part.done;
    for a call function_call_arguments.delta..., function_call_arguments.done) and output_item.done;
    then response.completed with the whole response and usage (status "incomplete" when cut off, as
    vLLM sends it)."""

    def __init__(self, head: ResponseObject):
        self.head, self.sequence_number = head, 0
        # the output so far; the last one may be open
        self.items: list[OutputMessage | FunctionCall] = []
        self.open = False

    def event(self, type: str, **data) -> str:
        dumped = {k: v.model_dump(mode="json", by_alias=True) if isinstance(v, BaseModel) else v
                  for k, v in data.items()}
        data = {"type": type, "sequence_number": self.sequence_number, **dumped}
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(data)}\n\n"

    def add(self, item: OutputMessage | FunctionCall) -> list[str]:
        events = self.close("completed")
        self.items.append(item)
        self.open = True
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=item))
        if isinstance(item, OutputMessage):
            events.append(self.event("response.content_part.added", **self.where(),
                                     part=OutputText(text="")))
            item.content.append(OutputText(text=""))
        return events

    def where(self) -> dict:
        return dict(item_id=self.items[-1].id, output_index=len(self.items) - 1) | \
            (dict(content_index=0) if isinstance(self.items[-1], OutputMessage) else {})

    def text(self, delta: str) -> list[str]:
        events = [] if self.open and isinstance(self.items[-1], OutputMessage) else \
            self.add(OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[]))
        self.items[-1].content[0].text += delta
        return events + [self.event("response.output_text.delta", **self.where(), delta=delta,
                                    logprobs=[])]

    def call(self, delta: ToolCallDelta) -> list[str]:
        events = []
        if delta.id is not None:  # a new call: its first delta names it
            events = self.add(FunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=delta.id,
                                           name=delta.function["name"], arguments="",
                                           status="in_progress"))
        arguments = delta.function.get("arguments") or ""
        if arguments:
            self.items[-1].arguments += arguments
            events.append(self.event("response.function_call_arguments.delta", **self.where(),
                                     delta=arguments))
        return events

    def close(self, status: str) -> list[str]:
        """The open item's last events."""
        if not self.open:
            return []
        self.open, item = False, self.items[-1]
        item.status = status
        if isinstance(item, OutputMessage):
            text = item.content[0]
            events = [self.event("response.output_text.done", **self.where(), text=text.text,
                                 logprobs=[]),
                      self.event("response.content_part.done", **self.where(), part=text)]
        else:
            events = [self.event("response.function_call_arguments.done", **self.where(),
                                 arguments=item.arguments)]
        return events + [self.event("response.output_item.done", output_index=len(self.items) - 1,
                                    item=item)]

    async def stream(self, chunks: Chunks) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.head)
        yield self.event("response.in_progress", response=self.head)
        finish_reason, usage = None, Usage()
        async for chunk in chunks:
            if isinstance(chunk, APIError):
                # the status line is sent already: the error as an event, the end
                e = renamed(chunk)
                yield self.event("error", code=e.code, message=e.message, param=e.param)
                return
            usage = chunk.usage or usage
            for choice in chunk.choices:
                for event in self.text(choice.delta.content) if choice.delta.content else []:
                    yield event
                for delta in choice.delta.tool_calls or []:
                    for event in self.call(delta):
                        yield event
                finish_reason = choice.finish_reason or finish_reason
        for event in self.close("incomplete" if finish_reason == "length" else "completed"):
            yield event
        yield self.event("response.completed",
                         response=finished(self.head, self.items, finish_reason, usage))


def add_responses(router: APIRouter, chat, model_name: str) -> None:
    """chat: the chat route's answer, `await chat(ChatCompletionRequest, raw)`: whole, streamed
    chunks or a 499."""

    @router.post("/responses", response_model=ResponseObject)
    async def responses(request: ResponsesRequest, raw: Request):
        refuse_stored_state(request)
        chat_request = as_chat(request)
        head = ResponseObject(
            id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()),
            model=request.model or model_name, status="in_progress",
            instructions=request.instructions, parallel_tool_calls=request.parallel_tool_calls,
            tool_choice=request.tool_choice or "auto", tools=request.tools or [],
            temperature=chat_request.temperature, top_p=chat_request.top_p,
            max_output_tokens=request.max_output_tokens,
            text=request.text or TextConfig(format=TextFormat(type="text")))
        try:
            answer = await chat(chat_request, raw)
        except APIError as e:
            raise renamed(e) from e
        if request.stream:
            return StreamingResponse(ResponseEvents(head).stream(answer),
                                     media_type="text/event-stream")
        if not isinstance(answer, Response):  # 499: the client went away
            return answer
        (choice,) = answer.choices
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return finished(head, output_items(choice.message, status), choice.finish_reason,
                        answer.usage)
