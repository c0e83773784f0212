"""From the engine back to the client: the prompts' delta outputs (`app.merge`) as OpenAI's
completions and chat completions, joined into one answer (`collect`) or as a stream of chunks
(`stream_chunks`), which `server_sent_events` sends as `data:` lines. The Responses API
(serving/responses.py) reshapes the same chunks.
"""
import json
from collections.abc import AsyncIterator

from nanoserve.outputs import RequestOutput
from nanoserve.serving.echo import Echo
from nanoserve.serving.logprobs import LogprobsFormat
from nanoserve.serving.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    CompletionChoice,
    DeltaMessage,
    Response,
    Usage,
)
from nanoserve.serving.tool_stream import ToolCallStream

# (prompt index, delta output), in the order they come
Outputs = AsyncIterator[tuple[int, RequestOutput]]
# a stream's chunks; an error ends it (the status line is sent already)
Chunks = AsyncIterator[Response | APIError]


def make_choice(chat: bool, stream: bool, index: int, text: str, finish_reason=None,
                stop_reason=None, logprobs=None):
    kw = dict(index=index, finish_reason=finish_reason, stop_reason=stop_reason, logprobs=logprobs)
    if not chat:
        return CompletionChoice(text=text, **kw)
    if stream:
        return ChatChunkChoice(delta=DeltaMessage(content=text), **kw)
    return ChatChoice(message=DeltaMessage(role="assistant", content=text), **kw)


async def collect(outputs: Outputs, header: dict, chat: bool, n: int,
                  logprobs: LogprobsFormat | None, echo: Echo | None) -> Response:
    """The whole answer at once: the deltas of each prompt's n sequences joined, choice
    i * n + j."""
    texts, token_ids, lps, endings, num_tokens, usage = {}, {}, {}, {}, {}, Usage()
    async for i, out in outputs:
        c = out.outputs[0]
        num_tokens[i] = num_tokens.get(i, 0) + len(c.token_ids)
        index = i * n + c.index
        shown = echo.prepend(i, out, c) if echo and index not in texts else c
        texts[index] = texts.get(index, "") + shown.text
        token_ids.setdefault(index, []).extend(shown.token_ids)
        lps.setdefault(index, []).extend(shown.logprobs or [])
        endings[index] = (c.finish_reason, c.stop_reason)
        if out.finished:
            usage.add(len(out.prompt_token_ids), num_tokens[i], out.num_cached_tokens)
    choices = [make_choice(chat, False, j, texts[j], *endings[j],
                           logprobs and logprobs(token_ids[j], lps[j]))
               for j in sorted(texts)]
    return Response(**header, choices=choices, usage=usage)


async def stream_chunks(outputs: Outputs, header: dict, chat: bool, num_choices: int, n: int,
                        logprobs: LogprobsFormat | None, include_usage: bool, echo: Echo | None,
                        tool_calls: ToolCallStream | None = None) -> Chunks:
    """A chunk per delta (choice i * n + j), a last one per choice with finish_reason, then usage if
    asked.
    tool_calls: turns the text into tool-call deltas (serving/tool_stream.py)."""
    num_tokens, text_lens, usage = {}, {}, Usage()
    try:
        if chat:  # OpenAI's first chunk names the role
            choices = [ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                       for j in range(num_choices)]
            yield Response(**header, choices=choices)
        async for i, out in outputs:
            c = out.outputs[0]
            num_tokens[i] = num_tokens.get(i, 0) + len(c.token_ids)
            index = i * n + c.index
            # (the first chunk)
            shown = echo.prepend(i, out, c) if echo and index not in text_lens else c
            if shown.text or c.finish_reason or shown.logprobs:
                lps = logprobs and logprobs(shown.token_ids, shown.logprobs or [],
                                            text_lens.get(index, 0))
                choice = make_choice(chat, True, index, shown.text, c.finish_reason, c.stop_reason,
                                     lps)
                if tool_calls is None or tool_calls.rewrite(choice):
                    yield Response(**header, choices=[choice])
            text_lens[index] = text_lens.get(index, 0) + len(shown.text)
            if out.finished:
                usage.add(len(out.prompt_token_ids), num_tokens[i], out.num_cached_tokens)
        if include_usage:
            yield Response(**header, choices=[], usage=usage)
    except Exception as e:  # reported in the stream, as vLLM does
        yield e if isinstance(e, APIError) else APIError(500, f"{type(e).__name__}: {e}",
                                                         type="server_error")


def event(data: Response | dict | str) -> str:
    if isinstance(data, Response):
        data = data.model_dump_json()
    elif not isinstance(data, str):
        data = json.dumps(data)
    return f"data: {data}\n\n"


async def server_sent_events(chunks: Chunks) -> AsyncIterator[str]:
    """OpenAI's stream: `data: {chunk}` per chunk (an error as `data: {"error": ...}`), then
    `data: [DONE]`."""
    async for chunk in chunks:
        yield event(chunk.body() if isinstance(chunk, APIError) else chunk)
    yield event("[DONE]")
