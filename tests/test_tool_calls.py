"""Tool calls at the server, without a server: streaming parsers fed a text cut anywhere (serving/tool_stream.py)
and tool messages in the chat history given to the chat template (serving/tool_messages.py). The end-to-end
versions, through the openai client, are in tests/test_serving.py."""
import json

import pytest
from transformers import AutoTokenizer

from nanoserve.serving.protocol import APIError, ChatChunkChoice, ChatCompletionRequest, ChatMessage, DeltaMessage
from nanoserve.serving.structured import parse_hermes
from nanoserve.serving.tool_messages import conversation
from nanoserve.serving.tool_stream import ToolCallStream

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REQUIRED = '[{"name": "f", "parameters": {"s": "a,}]\\" b", "n": [1, {"x": null}]}}, {"name": "g", "parameters": {}}]'
HERMES = ('Let me look. <tool_call>\n{"name": "f", "arguments": {"s": "<tool_call>", "n": 12.5}}\n</tool_call>\n'
          '<tool_call>{"arguments": {"k": true}, "name": "g"}</tool_call>')


def stream(mode: str, text: str, size: int, finish_reason: str = "stop") -> tuple[str | None, list, str]:
    """Feed text in chunks of `size` characters; reassemble the deltas as a client would."""
    tool_choice = {"type": "function", "function": {"name": "f"}} if mode == "named" else mode
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[TOOL], stream=True,
                                    tool_choice=tool_choice)
    tools = ToolCallStream.of(request, "hermes")
    content, calls, last = "", [], None
    for start in range(0, len(text), size):
        end = start + size >= len(text)
        choice = ChatChunkChoice(index=0, delta=DeltaMessage(content=text[start : start + size]),
                                 finish_reason=finish_reason if end else None)
        if not tools.rewrite(choice):
            continue
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function"
                calls.append([call.function["name"], ""])
            calls[call.index][1] += call.function["arguments"]
        last = choice.finish_reason
    parse = json.loads if last == "tool_calls" else str  # (cut off: the arguments' text so far)
    return content or None, [(name, parse(arguments)) for name, arguments in calls], last


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_calls_reassemble_whatever_the_chunks(size):
    assert stream("named", '{"s": "x}", "n": -3e2}', size) == (None, [("f", {"s": "x}", "n": -300.0})], "tool_calls")
    calls = [(c["name"], c["parameters"]) for c in json.loads(REQUIRED)]
    assert stream("required", REQUIRED, size) == (None, calls, "tool_calls")
    assert stream("auto", HERMES, size) == ("Let me look.", parse_hermes(HERMES)[0], "tool_calls")
    # Text that only looks like a tag's start at its end, and no calls: all of it is content, finish as it was.
    assert stream("auto", "a < b <tool", size, "length") == ("a < b <tool", [], "length")
    # A malformed call cannot be taken back once streamed, but it is no call: content is the text before it.
    assert stream("auto", "x <tool_call>{oops</tool_call>", size) == ("x <tool_call>{oops</tool_call>", [], "stop")


def test_streamed_calls_cut_off_by_max_tokens_keep_length():
    assert stream("named", '{"s": "abc', 2, "length") == (None, [("f", '{"s": "abc')], "length")


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
HISTORY = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "one"},
           {"role": "assistant", "content": "Done.", "tool_calls": [{**CALL, "id": "call_2"}, {**CALL, "id": "c3"}]},
           {"role": "tool", "tool_call_id": "call_2", "content": "two"},
           {"role": "tool", "tool_call_id": "c3", "content": "three"}]
# Qwen's convention, cut down: a template that knows tool calls gets them as structured messages.
NATIVE_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'tool' %}<tool_response>{{ m.tool_call_id }}:{{ m.content }}"
    "</tool_response>{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function.name }}{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>"
    "{% endif %}{% endfor %}")


def test_tool_messages_in_the_hermes_convention_for_a_template_without_tools():
    messages = conversation([ChatMessage(**m) for m in HISTORY], "{{ m.content }}")
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": call},
                        {"role": "user", "content": "<tool_response>\none\n</tool_response>"},
                        {"role": "assistant", "content": f"Done.\n{call}\n{call}"},
                        {"role": "user", "content": "<tool_response>\ntwo\n</tool_response>\n"
                                                    "<tool_response>\nthree\n</tool_response>"}]


def test_tool_messages_natively_for_a_template_with_tools(converted):
    tokenizer = AutoTokenizer.from_pretrained(converted[1])
    messages = conversation([ChatMessage(**m) for m in HISTORY[:3]], NATIVE_TEMPLATE)
    text = tokenizer.apply_chat_template(messages, chat_template=NATIVE_TEMPLATE, tokenize=False)
    assert text == ('<|im_start|>user\nq<|im_end|><|im_start|>assistant\n<tool_call>f{"x": 1}</tool_call><|im_end|>'
                    "<tool_response>call_1:one</tool_response>")


@pytest.mark.parametrize("messages, message", [
    ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[0].tool_call_id: 'call_1' is not"),
    (HISTORY[:2] + [{"role": "tool", "content": "x"}], "messages[2].tool_call_id: a tool message needs"),
    (HISTORY[:2] + [{"role": "tool", "tool_call_id": "call_1"}], "messages[2].content: a tool message needs"),
    (HISTORY[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}], "messages[2].tool_call_id: 'call_9'"),
    (HISTORY[:3] + [{"role": "tool", "tool_call_id": "call_2", "content": "x"}], "messages[3].tool_call_id"),
    ([{"role": "assistant", "content": None}], "messages[0].content: an assistant message needs"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{x"}}]}],
     "messages[0].tool_calls[0].function.arguments: must be a JSON object"),
    ([{"role": "user", "content": "q", "tool_calls": [CALL]}], "messages[0].tool_calls: only an assistant"),
    ([{"role": "system", "content": "q", "tool_call_id": "c"}], "messages[0].tool_call_id: only a tool message"),
])
def test_bad_tool_messages_are_refused_naming_the_field(messages, message):
    with pytest.raises(APIError) as error:
        conversation([ChatMessage(**m) for m in messages], None)
    assert error.value.status_code == 400 and error.value.param == "messages"
    assert error.value.message.startswith(message), error.value.message
