"""The Responses API's request and response, as pydantic models (serving/protocol.py holds the chat
API's): what `POST /v1/responses` accepts (`ResponsesRequest`: a string or a list of input items,
instructions, function tools, text.format, ...) and what it answers (`ResponseObject`: the output
items, status, usage). Any field not declared here (built-in tools, `reasoning`, `include`, ...) is
a 400 naming it (`RequestModel` forbids extras). serving/responses.py turns them into a chat request
and back.
"""
from typing import Annotated, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from nanoserve.serving.protocol import RequestModel


# ---- the request ---------------------------------------------------------------------------------
class TextPart(RequestModel):
    # output_text: an earlier answer's, sent back in the history
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # (an earlier answer's, sent back: nanoserve makes none)


class BaseInputItem(RequestModel):
    """An item of the input: an earlier output item sent back keeps its id and status, which name
    it, no more."""

    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class MessageItem(BaseInputItem):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]  # developer: a system message
    content: str | list[TextPart]


class FunctionCallItem(BaseInputItem):
    """A call the model made (an earlier answer's function_call item, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text


class FunctionCallOutputItem(BaseInputItem):
    """What running that call gave: its result for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


def item_type(item) -> str | None:
    """Which kind of input item: its `type`, a message without one (OpenAI's "easy input
    message")."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")]
                      | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                      Discriminator(item_type)]


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    # json_schema: the schema's name, description and strictness (always strict here: the output
    # is constrained to the schema)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat


class FunctionTool(RequestModel):
    # only functions: built-in tools (web_search, file_search, ...) are a 400
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # as chat's (protocol.ToolFunction)


class NamedTool(RequestModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = None  # None: up to max_model_len, as in vLLM
    temperature: float | None = None  # None: 1
    top_p: float | None = None  # None: 1
    # text.format: json_schema or json_object (structured outputs), or text
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True  # false: at most one call
    stream: bool = False
    store: bool | None = None  # nanoserve keeps nothing: only false (or unset) is honest
    previous_response_id: str | None = None  # refused: no response is kept to continue from


# ---- the response --------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str  # what the call's function_call_output names
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The answer, and the snapshot that the streamed lifecycle events carry."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None
    output: list[OutputMessage | FunctionCall] = []
    parallel_tool_calls: bool
    tool_choice: Literal["none", "auto", "required"] | NamedTool
    tools: list[FunctionTool]
    temperature: float
    top_p: float
    max_output_tokens: int | None
    text: TextConfig
    store: bool = False
    usage: ResponseUsage | None = None
