"""Tool calls in the chat history: what a client sends back after running a call the model asked
for.

The history then holds an assistant message carrying `tool_calls` (content null) and, per call, a
message with role "tool", the call's `tool_call_id` and its result as `content`. Both are checked (a
400 naming the message and the field) and given to the chat template in the form it takes:
- a template that knows tool calls (it mentions `tool_calls`, as Qwen's does) gets them as Hugging
  Face's chat templates expect them: the assistant's `tool_calls` with `arguments` as a dict, tool
  messages as they are;
- any other (the demo model's, which renders only `role` and `content`) gets them written out as
  text in the hermes convention that the hermes tool parser reads back: each call as
  `<tool_call>{"name", "arguments"} </tool_call>` in the assistant's content, and the results of
  consecutive tool messages as one user turn of `<tool_response>...</tool_response>` blocks.
"""
import json

from nanoserve.serving.protocol import APIError, ChatMessage


def conversation(messages: list[ChatMessage], chat_template: str | None) -> list[dict]:
    """The messages as `apply_chat_template` takes them, after `check_tool_messages`."""
    check_tool_messages(messages)
    if chat_template is not None and "tool_calls" in chat_template:
        return [native(m) for m in messages]
    turns: list[dict] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            response = f"<tool_response>\n{m.text()}\n</tool_response>"
            if messages[i - 1].role == "tool":  # the results of one round of calls make one turn
                turns[-1]["content"] += "\n" + response
            else:
                turns.append({"role": "user", "content": response})
            continue
        calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                 for c in m.tool_calls or []]
        calls = [f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls]
        text = [m.text()] if m.text() else []
        turns.append({"role": m.role, "content": "\n".join(text + calls)})
    return turns


def native(m: ChatMessage) -> dict:
    content = m.text() if m.content is not None or not m.tool_calls else None
    message = {"role": m.role, "content": content}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
            for c in m.tool_calls]
    if m.role == "tool":
        message["tool_call_id"] = m.tool_call_id
    return message


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """OpenAI's rules: a tool message answers a call of the assistant message before it (by
    tool_call_id) and has content; tool_calls belong to assistant messages, whose arguments are a
    JSON object; an assistant message has content or tool_calls."""
    call_ids: set[str] = set()  # the calls of the latest assistant message that made some
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.tool_calls is not None and m.role != "assistant":
            raise APIError(400, f"{where}.tool_calls: only an assistant message has tool_calls, "
                           f"not {m.role!r}", "messages")
        if m.tool_call_id is not None and m.role != "tool":
            raise APIError(400, f"{where}.tool_call_id: only a tool message has one, "
                           f"not {m.role!r}", "messages")
        if m.role == "assistant":
            if m.content is None and not m.tool_calls:
                raise APIError(400, f"{where}.content: an assistant message needs content or "
                               "tool_calls", "messages")
            for j, call in enumerate(m.tool_calls or []):
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError as e:
                    arguments = e
                if not isinstance(arguments, dict):
                    raise APIError(400, f"{where}.tool_calls[{j}].function.arguments: must be a "
                                   f"JSON object, got {call.function.arguments[:40]!r}", "messages")
            if m.tool_calls:
                call_ids = {call.id for call in m.tool_calls}
        elif m.role == "tool":
            if m.tool_call_id is None:
                raise APIError(400, f"{where}.tool_call_id: a tool message needs the id of the "
                               "call it answers", "messages")
            if m.tool_call_id not in call_ids:
                raise APIError(400, f"{where}.tool_call_id: {m.tool_call_id!r} is not a call of "
                               "the assistant message before it "
                               f"(its calls: {sorted(call_ids)})", "messages")
            if m.content is None:
                raise APIError(400, f"{where}.content: a tool message needs the call's result",
                               "messages")
