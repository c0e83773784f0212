"""The OpenAI API's requests and responses as pydantic models: FastAPI validates the JSON against
them.

Only what nanoserve can honour is declared (plus vLLM's extensions top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, priority, stop_token_ids, include_stop_str_in_output, structured_outputs,
and use_beam_search with best_of, length_penalty, early_stopping: nanoserve/serving/beam.py). A
request with any other field is a 400 naming it (`extra="forbid"`): a field the server would drop
silently is a promise it would break silently. The Responses API's models are in
serving/responses_protocol.py, the utility routes' in serving/tokenization.py.
"""
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

# the most likely tokens a response may list per position (vLLM's default max_logprobs)
MAX_LOGPROBS = 20


# ---- requests ---------------------------------------------------------------------------------
class RequestModel(BaseModel):
    """What a client sends: an unknown field is refused, naming it, rather than ignored. Python's
    JSON reader takes NaN and Infinity (and 1e999 is infinity): a 400 naming the field, not a
    number."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")


class StreamOptions(RequestModel):
    include_usage: bool = False  # a last chunk with `usage` and no choices


class SamplingRequest(RequestModel):
    """The fields completions and chat share: which model, how to sample, when to stop, how to
    answer."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None  # None: up to max_model_len, as in vLLM
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    priority: int = 0  # with --scheduling-policy priority: lower is served first
    stream: bool = False
    stream_options: StreamOptions | None = None
    # completions per prompt (up to the server's max_num_seqs); strict: `true` is not 1
    n: StrictInt = 1
    # The output matches a JSON schema, regex, choice or grammar (nanoserve/serving/structured.py):
    # {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}
    response_format: dict | None = None
    # vLLM's: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}
    structured_outputs: dict | None = None
    user: str | None = None  # accepted and ignored, as OpenAI does for logging
    # Disaggregated prefill (serving/proxy.py), vLLM's: {"do_remote_decode": true} on the prefill
    # instance, then what it answered ({"do_remote_prefill": true, ...}) on the decode instance
    kv_transfer_params: dict | None = None
    # vLLM's beam search extension (nanoserve/serving/beam.py): beam width best_of, else n; the n
    # best returned
    use_beam_search: bool = False
    best_of: StrictInt | None = None  # only with use_beam_search (or equal to n)
    length_penalty: float = 1.0  # a finished beam scores sum_logprobs / length ** length_penalty
    # transformers' stopping rule (docs/beam_search.md)
    early_stopping: StrictBool | Literal["never"] = False

    def num_prompt_logprobs(self) -> int | None:
        return None


class CompletionRequest(SamplingRequest):
    # a string, a list of strings, token ids, or a list of token-id lists: one choice per prompt
    prompt: str | list[str] | list[int] | list[list[int]]
    # per token: its logprob and the k most likely
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the text (and logprobs) start with the prompt; then max_tokens may be 0

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(RequestModel):
    name: str
    arguments: str  # the arguments as JSON text


class ToolCall(RequestModel):
    """A call the assistant made: in a response's message, and in the chat history a client sends
    back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
    role: str
    content: str | list[TextPart] | None = None
    # role "assistant": the calls it made (content may be null then)
    tool_calls: list[ToolCall] | None = None
    # role "tool": which call this is the result of (serving/tool_messages.py)
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ToolFunction(RequestModel):
    name: str
    description: str | None = None
    # a JSON schema
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    # OpenAI's "the arguments match the schema": what "required" and a named function do always (the
    # grammar); under "auto" the parser reads what the model wrote, as vLLM's does (docs/serving.md)
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: ToolFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    # "none", "auto" (default with tools), "required" or a named function
    tool_choice: str | dict | None = None
    # false: at most one call (the grammar allows one; "auto": the first is kept)
    parallel_tool_calls: bool = True
    # OpenAI's newer name for max_tokens; wins when both are set
    max_completion_tokens: int | None = None
    logprobs: bool = False  # per token: its logprob, and the top_logprobs most likely ones
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses --------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails(cached_tokens=0)

    def add(self, num_prompt: int, num_completion: int, num_cached: int) -> None:
        self.prompt_tokens += num_prompt
        self.completion_tokens += num_completion
        self.total_tokens += num_prompt + num_completion
        cached = self.prompt_tokens_details.cached_tokens + num_cached
        self.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (with echo, the prompt's
    first: their first logprob and top_logprobs are null, nothing comes before the first token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    # the most likely tokens at each position, text -> logprob
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token starts in the choice's text


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's UTF-8 bytes


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class Choice(BaseModel):
    index: int  # with n: prompt_index * n + the sequence's index
    logprobs: CompletionLogprobs | ChatLogprobs | None = None
    # "stop" (EOS, stop token, stop string, complete grammar), "length", "tool_calls"; None while
    # streaming
    finish_reason: str | None = None
    # the stop token id or stop string that ended it (None for EOS)
    stop_reason: int | str | None = None


class CompletionChoice(Choice):
    text: str


class ToolCallDelta(BaseModel):
    """A streamed piece of a tool call: its first names it (id, type, function.name), the next ones
    carry function.arguments fragments; `index` says which call of the message
    (serving/tool_stream.py)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict  # {"name"?: ..., "arguments": the next piece of JSON text}


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | list[ToolCallDelta] | None = None  # (deltas: streamed)


class ChatChoice(Choice):
    message: DeltaMessage  # the whole answer


class ChatChunkChoice(Choice):
    delta: DeltaMessage  # the next piece of the answer (streamed)


class Response(BaseModel):
    """A completion, a chat completion, or one streamed chunk of either (`object` tells which)."""

    id: str
    object: Literal["text_completion", "chat.completion", "chat.completion.chunk"]
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice] | list[ChatChoice] | list[ChatChunkChoice]
    usage: Usage | None = None
    # a prefill instance's answer: where the decode instance finds the KV
    kv_transfer_params: dict | None = None


# ---- errors -----------------------------------------------------------------------------------
class APIError(Exception):
    """An error the client caused, answered in OpenAI's shape: {"error": {"message", "type",
    "param", "code"}}."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status_code, self.message, self.param = status_code, message, param
        self.code, self.type = code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
