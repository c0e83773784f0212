"""Text on the demo model (byte-level BPE): streamed deltas add up to the full text, multi-byte characters
included; stop strings across token boundaries, with and without the stop string, and with min_tokens; final-only
text without stop strings decoded once, at the end."""
import asyncio

import pytest
from tokenizers.decoders import DecodeStream

from nanoserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from nanoserve.engine import sequence

EMOJI = "Write one emoji and say café:"  # plain text: the model answers with emoji split over tokens
CAFE = [{"role": "user", "content": "Write the French word for coffee, with its accent, three times."}]


@pytest.fixture(scope="module")
def demo(converted):
    llm = AsyncLLM(str(converted[1]), max_model_len=256, cpu_kvcache_space=0.25)
    yield llm
    llm.shutdown()


def chat_prompt(llm: AsyncLLM, messages) -> dict:
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)}


def run(llm: AsyncLLM, prompt, **params) -> tuple[list, list]:
    """The same request twice at once: streamed as deltas, and final only."""
    async def collect(kind):
        sp = SamplingParams(temperature=0, max_tokens=24, output_kind=kind, **params)
        return [out async for out in llm.generate(prompt, sp)]

    async def main():
        return await asyncio.gather(collect(RequestOutputKind.DELTA), collect(RequestOutputKind.FINAL_ONLY))

    return asyncio.run(main())


@pytest.mark.parametrize("which", ["emoji", "accents"])
def test_streamed_deltas_concatenate_to_the_full_text(demo, which):
    prompt = EMOJI if which == "emoji" else chat_prompt(demo, CAFE)
    deltas, (final,) = run(demo, prompt)
    text, ids = final.outputs[0].text, final.outputs[0].token_ids
    assert "".join(d.outputs[0].text for d in deltas) == text == demo.tokenizer.decode(ids, skip_special_tokens=True)
    assert sum((d.outputs[0].token_ids for d in deltas), []) == ids
    assert any(len(c.encode()) > 1 for c in text)
    # A token that ends inside a character gives no text; the character comes whole with a later token.
    # (Only a request cut off by max_tokens mid-character ends in U+FFFD, as decoding all at once does.)
    assert "\ufffd" not in "".join(d.outputs[0].text for d in deltas[:-1])
    if which == "emoji":
        assert any(demo.tokenizer.decode([t]).endswith("\ufffd") for t in ids)
        assert any(d.outputs[0].token_ids and not d.outputs[0].text for d in deltas)


def test_stop_strings_across_token_boundaries(demo):
    prompt = chat_prompt(demo, CAFE)
    _, (full,) = run(demo, prompt)
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    pieces = [demo.tokenizer.decode([t]) for t in ids]
    assert pieces[:4] == ["C", "af", "é", " au"] and text.count("Café au") >= 2
    stop = "fé a"  # ends inside the 4th token, begins inside the 2nd
    for include in (False, True):
        deltas, (final,) = run(demo, prompt, stop=["no such text", stop], include_stop_str_in_output=include)
        out = final.outputs[0]
        assert out.text == ("Café a" if include else "Ca")
        assert "".join(d.outputs[0].text for d in deltas) == out.text  # nothing after the cut was streamed
        assert out.token_ids == ids[:4] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    # The first match completes with the 4th token; with min_tokens=4 only a later one counts.
    _, (final,) = run(demo, prompt, stop=stop, min_tokens=4)
    second = text.index(stop, text.index(stop) + 1)
    assert final.outputs[0].text == text[:second] and final.outputs[0].stop_reason == stop


@pytest.fixture
def decode_steps(monkeypatch) -> list[int]:
    """The tokens detokenizers step through DecodeStream, one by one (the text as it goes)."""
    steps = []

    class CountingStream:
        def __init__(self, **kwargs):
            self.stream = DecodeStream(**kwargs)

        def step(self, tokenizer, token_id: int):
            steps.append(token_id)
            return self.stream.step(tokenizer, token_id)

    monkeypatch.setattr(sequence, "DecodeStream", CountingStream)
    return steps


def test_final_only_text_without_stop_strings_is_decoded_once_at_the_end(demo, decode_steps):
    deltas, (final,) = run(demo, EMOJI)  # the same request streamed and final only: the same text (above)
    assert len(decode_steps) == len(final.outputs[0].token_ids)  # the stream's steps only
    decode_steps.clear()
    _, (final,) = run(demo, EMOJI, stop=["no such text"])  # a stop string needs the text token by token
    assert len(decode_steps) == 2 * len(final.outputs[0].token_ids)


def test_llm_generate_asks_for_final_only_and_leaves_the_callers_params_alone(converted, decode_steps):
    llm = LLM(str(converted[1]), max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=16)
    (out,) = llm.generate([EMOJI], params, use_tqdm=False)
    assert not decode_steps and params.output_kind == RequestOutputKind.CUMULATIVE
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    (stopped,) = llm.generate([EMOJI], SamplingParams(temperature=0, max_tokens=16, stop=["no such text"]),
                              use_tqdm=False)
    assert stopped.outputs[0].text == out.outputs[0].text and len(decode_steps) == 16
