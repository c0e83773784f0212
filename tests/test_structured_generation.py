"""Structured outputs end to end on the demo model (its real tokenizer): every output parses and validates,
the mask is exact, and the combinations (n > 1, async scheduling, preemption by recompute and swap) keep it so.
The building blocks (specs, compile cache, masks against the vocabulary) are in tests/test_structured_outputs.py."""
import json
import re

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.core import EngineCore
from nanoserve.layers.sampler import Sampler
from nanoserve.layers.sampling_metadata import SamplingMetadata
from nanoserve.structured_outputs import StructuredOutputsParams

pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install 'nanoserve[structured]')")
from nanoserve.structured_output.manager import StructuredOutputManager  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")

OPTIONS = dict(max_model_len=512, num_kvcache_blocks=256, enable_structured_outputs=True)
NAME = {"type": "string", "maxLength": 10}
# Ten schemas: nested objects, arrays, enums, required fields, numbers with bounds (strings and arrays bounded,
# so a small model's greedy output always ends within max_tokens).
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"city": NAME, "location": {
        "type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                         "lon": {"type": "number", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"]}}, "required": ["city", "location"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["ok", "score"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "kind": {"enum": ["a", "b"]}}, "required": ["id", "kind"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "why": NAME},
     "required": ["answer", "why"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "first": NAME, "last": NAME, "admin": {"type": "boolean"}}, "required": ["first", "last", "admin"]}},
     "required": ["user"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}, "maxItems": 4}},
     "required": ["n", "xs"]},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                      "genre": {"enum": ["drama", "comedy"]}}, "required": ["title", "year", "genre"]},
]
PROMPTS = ["Describe it as JSON:", "Here is the data in JSON format:", "Output:", "The answer, as JSON:",
           "A record about a famous person:"]


@pytest.fixture(scope="module")
def llm(converted):
    return LLM(str(converted[1]), **OPTIONS)


def structured(kind: str, value, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 80, **kwargs},
                          structured_outputs=StructuredOutputsParams(**{kind: value}))


def test_fifty_json_schema_requests_all_validate(llm):
    params = [structured("json", schema) for schema in SCHEMAS for _ in PROMPTS]
    outputs = llm.generate([p for _ in SCHEMAS for p in PROMPTS], params, use_tqdm=False)
    assert len(outputs) == 50
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMAS[i // len(PROMPTS)])
    compiler = llm.engine.structured_output_manager.compiler
    assert compiler.num_compiled >= len(SCHEMAS)  # once per distinct schema


def test_regex_choice_grammar_and_json_object(llm):
    cases = [("regex", r"\d{3}-\d{4}", lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
             ("regex", r"(cat|dog)s? (run|sleep)", lambda t: re.fullmatch(r"(cat|dog)s? (run|sleep)", t)),
             ("choice", ["Paris", "London", "Rome"], lambda t: t in ["Paris", "London", "Rome"]),
             ("grammar", 'root ::= "(" [0-9] ("+" [0-9])* ")"', lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t)),
             ("json_object", True, lambda t: isinstance(json.loads(t), dict))]
    for temperature in (0.0, 1.0):
        params = [structured(kind, value, temperature=temperature, seed=7) for kind, value, _ in cases]
        outputs = llm.generate(["The capital of France is"] * len(cases), params, use_tqdm=False)
        for (kind, _, check), output in zip(cases, outputs):
            assert output.outputs[0].finish_reason == "stop" and check(output.outputs[0].text), (kind, output)


def test_unconstrained_greedy_output_is_unchanged(llm):
    prompt, greedy = "The capital of France is", SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([prompt, prompt], [greedy, structured("json_object", True)], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone


def test_every_sampled_token_is_allowed_at_its_position(llm):
    """Sampling at temperature 2 (the model would wander anywhere) from a grammar over a few tokens; replaying
    each output through a fresh matcher, every token is in the mask at its position, and the last one ends it."""
    from nanoserve.structured_output.grammar import allocate_bitmask

    grammar = 'root ::= ("ab" | "cd" | " x")+ "."'
    params = structured("grammar", grammar, temperature=2.0, n=4, seed=0, max_tokens=40)
    outputs = llm.generate(["Letters:", "Go"], params, use_tqdm=False)
    compiler = llm.engine.structured_output_manager.compiler
    for completion in (c for o in outputs for c in o.outputs):
        matcher = compiler.matcher(StructuredOutputsParams(grammar=grammar))
        for token_id in completion.token_ids:
            bitmask = allocate_bitmask(1, compiler.vocab_size)
            matcher.fill_bitmask(bitmask, 0)
            assert bitmask[0, token_id // 32] >> (token_id % 32) & 1, (completion.token_ids, token_id)
            assert matcher.accept(token_id)
        if completion.finish_reason == "stop":
            assert matcher.is_terminated() and re.fullmatch(r"(ab|cd| x)+\.", completion.text)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_mask_with_a_single_token_gives_that_token(temperature):
    """The sampler's side (the grammar's logits processor, in layers/sampler.py rule_out), with top-k, top-p and
    penalties: only the allowed token can come out, even where it is the least likely one; the columns past the
    bitmask's last word never do."""
    logits = torch.randn(3, 100) * 5
    allowed = [7, 99, 64]
    bitmask = torch.zeros(3, 4, dtype=torch.int32)
    for row, token_id in enumerate(allowed):
        bitmask[row, token_id // 32] = 1 << (token_id % 32) if token_id % 32 != 31 else -(2 ** 31)
        logits[row, token_id] = -50.0
    rows = torch.full((3,), temperature)
    sampling = SamplingMetadata(temperatures=None if temperature == 0 else rows, top_ks=torch.full((3,), 5),
                                top_ps=torch.full((3,), 0.5), min_ps=None, generators=[None] * 3,
                                logits_processors=[(StructuredOutputManager, bitmask)])
    for _ in range(5):
        assert Sampler()(logits, sampling).tolist() == allowed


@pytest.mark.parametrize("options", [dict(async_scheduling=True),
                                     dict(num_kvcache_blocks=10, max_num_seqs=8),
                                     dict(num_kvcache_blocks=10, max_num_seqs=8, preemption_mode="swap",
                                          swap_space=0.05),
                                     dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                                          max_num_batched_tokens=32)])
def test_combinations_give_the_same_outputs(converted, llm, options):
    """Async scheduling (a structured request sits out the planned step its mask is not known for), preemption
    (the matcher lives on the sequence: recompute and swap leave it as it is), prefix caching with chunked
    prefill, and n > 1 (a matcher per sequence): the same greedy and seeded outputs as the plain engine."""
    prompts = ["Describe it as JSON:", "A record about a famous person:"] * 3
    params = [structured("json", SCHEMAS[i % len(SCHEMAS)], max_tokens=60) for i in range(len(prompts) - 1)]
    params.append(structured("json", SCHEMAS[0], temperature=1.0, seed=3, n=2, max_tokens=60))
    expected = llm.generate(prompts, params, use_tqdm=False)
    other = LLM(str(converted[1]), **{**OPTIONS, **options})
    outputs = other.generate(prompts, params, use_tqdm=False)
    for got, want in zip(outputs, expected):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        for c in got.outputs:
            assert c.finish_reason == "stop"
            json.loads(c.text)
    if "num_kvcache_blocks" in options:
        assert other.stats.num_preemptions > 0
    if "preemption_mode" in options:
        assert other.stats.num_swapped_out > 0


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def replay(compiler, spec: StructuredOutputsParams, token_ids: list[int]) -> None:
    """A fresh matcher through the output: every token is in the mask at its position."""
    from nanoserve.structured_output.grammar import allocate_bitmask

    matcher = compiler.matcher(spec)
    for token_id in token_ids:
        bitmask = allocate_bitmask(1, compiler.vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        assert bitmask[0, token_id // 32] >> (token_id % 32) & 1, (token_ids, token_id)
        assert matcher.accept(token_id)


def test_speculative_decoding_masks_each_drafted_position(converted, llm):
    """N-gram drafts for structured requests: each is cut where the grammar refuses it, each drafted position
    gets its own mask, and only the emitted tokens advance the matcher. Greedy output equals the engine's
    without speculation (json schema, regex, choice, next to an unconstrained request); drafts are proposed and
    accepted; sampled at temperature 2, every token is still allowed at its position."""
    spec_llm = LLM(str(converted[1]), **OPTIONS, speculative_config=SPEC)
    items = {"type": "object", "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "kind": {"enum": ["apple", "banana"]}}, "required": ["id", "kind"]}}},
             "required": ["items"]}
    cases = [("A list of fruit as JSON:", structured("json", items)),
             ("Say it three times: ab cd ab cd ab cd", structured("regex", r"(ab|cd)( (ab|cd)){2,5}\.")),
             ("Answer with one of: New York City, Los Angeles. Answer:",
              structured("choice", ["New York City", "Los Angeles"]))]
    prompts, params = [p for p, _ in cases], [sp for _, sp in cases]
    expected = llm.generate(prompts, params, use_tqdm=False)
    outputs = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    json.loads(outputs[0].outputs[0].text)
    assert re.fullmatch(r"(ab|cd)( (ab|cd)){2,5}\.", outputs[1].outputs[0].text)
    assert outputs[2].outputs[0].text in ("New York City", "Los Angeles")
    stats = spec_llm.stats.spec_decoding
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats  # all three are constrained

    grammar, accepted = 'root ::= ("ab" | "cd" | " x")+ "."', stats.num_accepted_tokens
    prompts = ["Letters: ab cd ab cd x x ab", "Go ab ab ab", "The capital of France is"]
    params = [structured("grammar", grammar, temperature=2.0, n=3, seed=0, max_tokens=40)] * 2
    params.append(SamplingParams(temperature=0, max_tokens=24))
    sampled = spec_llm.generate(prompts, params, use_tqdm=False)
    for completion in (c for o in sampled[:2] for c in o.outputs):
        replay(spec_llm.engine.structured_output_manager.compiler, StructuredOutputsParams(grammar=grammar),
               completion.token_ids)
        assert completion.finish_reason == "length" or re.fullmatch(r"(ab|cd| x)+\.", completion.text)
    assert spec_llm.stats.spec_decoding.num_accepted_tokens > accepted
    # An unconstrained request next to them: as without speculation.
    alone = llm.generate(prompts[2:], params[2:], use_tqdm=False)[0]
    assert sampled[2].outputs[0].token_ids == alone.outputs[0].token_ids


def test_bad_specs_are_refused_before_any_work(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: "):
        structured("regex", "(unclosed")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    with pytest.raises(ValueError, match="min_tokens: must be 0 with structured_outputs"):
        structured("choice", ["a"], min_tokens=1)


def test_a_model_without_a_tokenizer_is_refused(tiny_models):
    """At build: the grammar's mask is built from the tokenizer's vocabulary."""
    with pytest.raises(ValueError, match="structured_outputs: this model folder has no tokenizer"):
        LLM(tiny_models["qwen3"], max_model_len=64, num_kvcache_blocks=8, enable_structured_outputs=True)


def test_an_engine_built_without_structured_outputs_refuses_them(converted):
    """The chapter is switched on by the config: without enable_structured_outputs a plain engine has none
    of it, and a structured request is refused naming the option, before any request is queued."""
    llm = LLM(str(converted[1]), max_model_len=64, num_kvcache_blocks=8)
    assert type(llm.engine) is EngineCore and not llm.engine.input_builder.logits_processors
    with pytest.raises(ValueError, match="^structured_outputs: this engine has no feature plugged in for it; "
                       "pass enable_structured_outputs=True$"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), structured("choice", ["a"], max_tokens=4)],
                     use_tqdm=False)
    assert not llm.engine.requests
