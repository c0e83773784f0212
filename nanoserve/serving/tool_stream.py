"""Tool calls streamed: the answer's text, as it comes, turned into OpenAI's `tool_calls` deltas.

A streamed call is a first delta that names it (`index`, `id`, `type`, `function.name`), then the
`arguments` JSON text in fragments; the choice's last chunk says `finish_reason: "tool_calls"`. The
text arrives a token at a time, so each chunk re-reads the whole text so far as calls cut off
anywhere (`partial_calls`) and sends what was not sent yet: a call's name once its string is whole,
then its arguments as they grow. Per tool mode:
- a named function: the constrained text is the arguments' JSON; the call is named before the first
  token.
- "required": the text is a JSON list `[{"name": ..., "parameters": {...}}, ...]`, constrained to
  the tools.
- "auto" with the hermes parser: text before the first `<tool_call>` streams as content; the end of
  the text that could be the start of a tag (and whitespace, which the whole answer strips before a
  call) is held back until the next token tells. Each `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` then streams as a call. vLLM's hermes parser does the same; where
  a call's text is malformed the streamed deltas cannot be taken back, while the whole answer keeps
  such text as content.
"""
import json
import re
import uuid
from dataclasses import dataclass, field

from nanoserve.serving.protocol import ChatChunkChoice, ChatCompletionRequest, ToolCallDelta
from nanoserve.serving.structured import tool_mode

TAG, END_TAG = "<tool_call>", "</tool_call>"
STRING = r'"(?:[^"\\]|\\.)*"'
Call = tuple[str | None, str]  # (the name once whole, the arguments' text so far)


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value that starts at text[start] (no whitespace) ends, or None if the text
    stops first."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            if not in_string and depth == 0:
                return i + 1
        elif ch == '"':
            in_string = True
        elif ch in ",]}" and depth == 0:  # the end of a number, true, false or null
            return i
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def partial_call(text: str, arguments_key: str) -> Call:
    """A call object {"name": ..., KEY: {...}} cut off anywhere. The name is read once its string is
    whole and the arguments once their key has come, if name comes first (it does in constrained
    output, whose keys keep the schema's order; a model writing hermes calls freely is read once the
    call is whole, in `auto_calls`)."""
    name = re.match(rf"\s*\{{\s*\"name\"\s*:\s*({STRING})", text)
    if name is None:
        return None, ""
    arguments = re.compile(rf'\s*,\s*"{arguments_key}"\s*:\s*').match(text, name.end())
    if arguments is None:
        return json.loads(name.group(1)), ""
    end = value_end(text, arguments.end())
    return json.loads(name.group(1)), text[arguments.end() : end]


def required_calls(text: str) -> list[Call]:
    """tool_choice "required": the calls of the JSON list so far."""
    calls, pos = [], text.find("[") + 1
    while pos:
        pos = len(text) - len(text[pos:].lstrip())  # (skip whitespace)
        if pos == len(text) or text[pos] == "]":
            break
        end = value_end(text, pos)
        calls.append(partial_call(text[pos:end], "parameters"))
        pos = end and text.find(",", end) + 1  # 0 (stop): the element or the list goes on later
    return calls


def auto_calls(text: str) -> tuple[str, list[Call]]:
    """tool_choice "auto", hermes: the content so far (before the first tag, less a possible tag
    start at its end), and the calls so far."""
    start = text.find(TAG)
    if start < 0:
        # hold back an end that may be the start of a tag ("<tool"), and whitespace before it
        held = next((n for n in range(len(TAG) - 1, 0, -1) if text.endswith(TAG[:n])), 0)
        return text[: len(text) - held].rstrip(), []
    content, calls = text[:start].rstrip(), []
    while start >= 0:
        # each call's body runs to the first end tag after its tag, as in parse_hermes
        end = text.find(END_TAG, start)
        body = text[start + len(TAG) : None if end < 0 else end]
        name, arguments = partial_call(body, "arguments")
        if end >= 0:
            # its JSON is complete: a call in another key order or without arguments is read whole
            # now
            try:
                call = json.loads(body)
                name, arguments = call["name"], arguments or json.dumps(call.get("arguments", {}))
            except (json.JSONDecodeError, KeyError, TypeError):  # malformed: not a call
                break
        calls.append((name, arguments))
        start = -1 if end < 0 else text.find(TAG, end)
    return content, calls


@dataclass
class ChoiceStream:
    """One choice's progress: its text so far, and how much of its content and of each call was
    sent."""

    text: str = ""
    content_sent: int = 0
    # (id, arguments characters sent)
    calls_sent: list[tuple[str, int]] = field(default_factory=list)


class ToolCallStream:
    """Rewrites a streamed chat request's chunks (one per choice's delta) when its tools are
    answered as calls."""

    def __init__(self, request: ChatCompletionRequest, mode: str):
        self.mode, self.parallel = mode, request.parallel_tool_calls
        self.name = request.tool_choice["function"]["name"] if mode == "named" else None
        self.choices: dict[int, ChoiceStream] = {}

    @classmethod
    def of(cls, request, tool_call_parser: str | None) -> "ToolCallStream | None":
        """None unless the request streams a chat with tools to be answered as calls."""
        if not (request.stream and isinstance(request, ChatCompletionRequest)):
            return None
        mode = tool_mode(request, tool_call_parser)
        return None if mode is None else cls(request, mode)

    def parse(self, text: str) -> tuple[str, list[Call]]:
        if self.mode == "named":
            return "", [(self.name, text)]
        if self.mode == "required":
            return "", required_calls(text)
        content, calls = auto_calls(text)
        # ("required": the grammar allows one call)
        return content, calls if self.parallel else calls[:1]

    def rewrite(self, choice: ChatChunkChoice) -> bool:
        """Turn the chunk's text delta into content and tool_calls deltas, in place; the
        finish_reason "stop" of a choice that made calls becomes "tool_calls". False if the chunk
        has nothing left to send."""
        state = self.choices.setdefault(choice.index, ChoiceStream())
        state.text += choice.delta.content or ""
        content, calls = self.parse(state.text)
        if choice.finish_reason is not None and not calls:
            # the end: what was held back is plain text
            content = state.text
        deltas = []
        for i, (name, arguments) in enumerate(calls):
            if name is None:
                break
            if i == len(state.calls_sent):  # a new call: its first delta names it
                state.calls_sent.append((f"call_{uuid.uuid4().hex[:24]}", 0))
                deltas.append(ToolCallDelta(index=i, id=state.calls_sent[i][0], type="function",
                                            function={"name": name, "arguments": arguments}))
            elif len(arguments) > state.calls_sent[i][1]:
                new = arguments[state.calls_sent[i][1]:]
                deltas.append(ToolCallDelta(index=i, function={"arguments": new}))
            state.calls_sent[i] = (state.calls_sent[i][0], len(arguments))
        choice.delta.content = content[state.content_sent:] or None
        state.content_sent = len(content)
        choice.delta.tool_calls = deltas or None
        if state.calls_sent and choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"
        return bool(choice.delta.content or deltas or choice.finish_reason or choice.logprobs)
