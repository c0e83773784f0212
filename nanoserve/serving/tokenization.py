"""The prompt as the engine sees it: chat messages through the chat template (`render_chat`, which
the chat and Responses routes use), and vLLM's utility routes beside OpenAI's, for tools that count
or inspect tokens:

- `POST /tokenize`: a `prompt` (with the tokenizer's special tokens unless
  `add_special_tokens: false`) or chat `messages` (through the template, as a chat request renders
  them) -> `{count, max_model_len, tokens, token_strs}` (`token_strs` with
  `return_token_strs: true`);
- `POST /detokenize`: `tokens` -> `{prompt}`, the text they decode to;
- `GET /version`: nanoserve's version; `GET /tokenizer_info`: the tokenizer's settings (its
  tokenizer_config.json as loaded, `tokenizer_class`, `chat_template`), which lm-evaluation-harness
  reads.
As in vLLM they sit at the root, beside /health, not under /v1 (so `--api-key` does not guard them).
"""
from collections.abc import Callable
from importlib.metadata import version

from fastapi import FastAPI
from pydantic import BaseModel

from nanoserve.serving.protocol import APIError, ChatMessage, RequestModel, Tool
from nanoserve.serving.tool_messages import conversation


def render_chat(tokenizer, messages: list[ChatMessage], tools: list[Tool] | None = None,
                add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
    """The messages (tool calls and results too: serving/tool_messages.py) through the model's chat
    template, which shows the tools to the model if it knows them."""
    if tokenizer is None:
        raise APIError(400, "messages: this model folder has no tokenizer, so no chat template",
                       "messages")
    turns = conversation(messages, tokenizer.chat_template)
    tool_dicts = [t.model_dump(exclude={"function": {"strict"}}) for t in tools] if tools else None
    try:
        text = tokenizer.apply_chat_template(turns, tools=tool_dicts, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # the template's own checks (jinja2 raises for roles it does not know)
        raise APIError(400, f"messages: the chat template refused them: {e}", "messages") from e
    # As in LLM.chat: the template already holds any special tokens, so encode must not add them
    # again.
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


class TokenizeRequest(RequestModel):
    """One of `prompt` (as /v1/completions takes a text) or `messages` (as /v1/chat/completions)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: the template shows them, as in a chat request
    add_generation_prompt: bool = True  # with messages: end with the assistant turn's opening
    # None: True for a prompt, False for messages (the template has them)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # also each token as the tokenizer spells it


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class TokenizerInfoResponse(BaseModel, extra="allow"):
    tokenizer_class: str  # and the settings of tokenizer_config.json, each a field
    chat_template: str | None = None


def tokenize(request: TokenizeRequest, tokenizer) -> list[int]:
    if (request.prompt is None) == (request.messages is None):
        raise APIError(400, "prompt: send one of prompt or messages", "prompt")
    if request.messages is None:
        if request.tools is not None or not request.add_generation_prompt:
            field = "tools" if request.tools is not None else "add_generation_prompt"
            raise APIError(400, f"{field}: only with messages", field)
        # as /v1/completions encodes a text (LLM's prompt_token_ids), unless asked without special
        # tokens
        return tokenizer.encode(request.prompt,
                                add_special_tokens=request.add_special_tokens is not False)
    return render_chat(tokenizer, request.messages, request.tools, request.add_generation_prompt,
                       add_special_tokens=bool(request.add_special_tokens))


def tokenizer_settings(tokenizer) -> dict:
    """tokenizer_config.json as loaded: each setting as JSON has it (special tokens as their
    text)."""
    def plain(value):
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)

    return {k: plain(v) for k, v in tokenizer.init_kwargs.items()}


def add_tokenization_routes(app: FastAPI, tokenizer, check_model: Callable[[str | None], object],
                            max_model_len: int) -> None:
    """check_model: a 404 for a model name the server does not serve (ServedModels.lora_request);
    the base model and its adapters share the tokenizer."""
    def check(request: TokenizeRequest | DetokenizeRequest, field: str) -> None:
        check_model(request.model)
        if tokenizer is None:
            raise APIError(400, f"{field}: this model folder has no tokenizer", field)

    @app.post("/tokenize")
    async def tokenize_route(request: TokenizeRequest) -> TokenizeResponse:
        check(request, "prompt" if request.messages is None else "messages")
        ids = tokenize(request, tokenizer)
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        check(request, "tokens")
        bad = next((t for t in request.tokens if not 0 <= t < len(tokenizer)), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is not a token id of this vocabulary "
                           f"(0 to {len(tokenizer) - 1})", "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    @app.get("/version")
    async def nanoserve_version() -> VersionResponse:
        return VersionResponse(version=version("nanoserve"))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> TokenizerInfoResponse:
        if tokenizer is None:
            raise APIError(404, "this model folder has no tokenizer", code="404")
        return TokenizerInfoResponse(**{**tokenizer_settings(tokenizer),
                                        "tokenizer_class": type(tokenizer).__name__,
                                        "chat_template": tokenizer.chat_template})

