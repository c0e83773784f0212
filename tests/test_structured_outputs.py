"""Structured outputs' building blocks (nanoserve/structured_outputs.py, nanoserve/structured_output/grammar.py) on
the demo model's tokenizer (49,152 byte-level BPE tokens): the specs' checks, the compile cache, and masks checked
against the whole vocabulary with Python's own bytes and regex rules, not with xgrammar's."""
import json
import re

import pytest
import torch

from nanoserve.structured_outputs import StructuredOutputsParams

xgr = pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install 'nanoserve[structured]')")
from transformers import AutoTokenizer  # noqa: E402

from nanoserve.structured_output.grammar import GrammarCompiler, allocate_bitmask, apply_bitmask  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(converted):
    return AutoTokenizer.from_pretrained(converted[1])


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def spelled(tokenizer) -> list[bytes | None]:
    """Every token's bytes (a token may hold part of a character); special tokens as None (never allowed).
    Byte-level BPE writes each byte as one printable character, GPT-2's table: this inverts it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    special = set(tokenizer.all_special_ids)
    return [None if t in special else bytes(byte_of[c] for c in tokenizer.convert_ids_to_tokens(t))
            for t in range(len(tokenizer))]


def allowed(matcher, vocab_size: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]: bit t % 32 of word t // 32
    return set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())


def test_specs_are_checked_naming_the_field():
    bad = [
        (dict(), "set exactly one of json, json_object, regex, choice, grammar; got none"),
        (dict(json_object=False), "got none"),
        (dict(regex="a+", choice=["a"]), "got regex and choice"),
        (dict(choice=[]), r"structured_outputs\.choice: needs at least one string"),
        (dict(choice=["a", 3]), r"structured_outputs\.choice: wrong type"),
        (dict(choice="yes"), r"structured_outputs\.choice: wrong type str"),
        (dict(regex=5), r"structured_outputs\.regex: wrong type int"),
        (dict(json_object="yes"), r"structured_outputs\.json_object: wrong type str"),
        (dict(json="{not json"), r"structured_outputs\.json: not valid JSON"),
        (dict(json={"type": "foo"}), r"structured_outputs\.json: Unsupported type \"foo\""),
        (dict(json='[1, 2]'), r"structured_outputs\.json: Schema should be an object"),
        (dict(json={"type": "integer", "minimum": 5, "maximum": 2}), r"structured_outputs\.json: Invalid range"),
        (dict(regex="[a-"), r"structured_outputs\.regex: Regex parsing error at position 4: Unclosed '\['"),
        (dict(grammar="root ::= foo"), r"structured_outputs\.grammar: .*Rule \"foo\" is not defined"),
        (dict(grammar='start ::= "a"'), r"structured_outputs\.grammar: .*root rule"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            StructuredOutputsParams(**kwargs)
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}  # the text, parsed


def test_compiles_each_distinct_spec_once(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    before = compiler.num_compiled
    first = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(schema))) is first  # as text: the same spec
    assert compiler.compile(StructuredOutputsParams(json={**schema, "required": ["a"]})) is not first
    # the order of properties is the order of the output's keys: another spec
    swapped = {"type": "object", "properties": dict(reversed(schema["properties"].items()))}
    assert compiler.compile(StructuredOutputsParams(json=swapped)) is not first
    for spec in (dict(regex="[0-9]+"), dict(regex="[0-9]+"), dict(choice=["x", "y"]), dict(json_object=True)):
        compiler.compile(StructuredOutputsParams(**spec))
    assert compiler.num_compiled - before == 6


@pytest.mark.parametrize("choices", [["yes", "no", "maybe"], ['say "hi"', "back\\slash", "new\nline", "héllo 😀"]])
def test_choice_masks_are_exact_and_it_terminates(compiler, tokenizer, spelled, choices):
    """At each step the mask allows exactly the tokens whose bytes continue one of the choices (checked over
    the whole vocabulary with bytes.startswith); following a choice token by token ends in EOS."""
    vocab_size, encoded = len(tokenizer), [c.encode() for c in choices]
    for target in choices:
        matcher, done = compiler.matcher(StructuredOutputsParams(choice=choices)), b""
        for token_id in tokenizer.encode(target):
            rest = [c[len(done):] for c in encoded if c.startswith(done) and c != done]
            expected = {t for t, s in enumerate(spelled) if s and any(r.startswith(s) for r in rest)}
            got = allowed(matcher, vocab_size)
            assert got == expected, (target, done)
            assert matcher.accept(token_id)
            done += spelled[token_id]
        assert done == target.encode() and not matcher.is_terminated()
        assert allowed(matcher, vocab_size) == {tokenizer.eos_token_id}  # complete: only the stop token
        assert not matcher.accept(tokenizer.encode("x")[0])  # refused, and nothing changed
        assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()


def test_regex_mask_is_exact_and_rollback_restores_it(compiler, tokenizer, spelled):
    """A three-digit number: the first token may be any run of 1 to 3 digits (re.fullmatch over every token's
    text), then only what completes it; rollback returns to the first mask."""
    matcher = compiler.matcher(StructuredOutputsParams(regex="[0-9]{3}"))
    first = allowed(matcher, len(tokenizer))
    assert first == {t for t, s in enumerate(spelled) if s is not None and re.fullmatch(b"[0-9]{1,3}", s)}
    one_digit = tokenizer.convert_tokens_to_ids("4")
    assert matcher.accept(one_digit)
    assert allowed(matcher, len(tokenizer)) == {t for t, s in enumerate(spelled)
                                                 if s is not None and re.fullmatch(b"[0-9]{1,2}", s)}
    assert not matcher.accept(tokenizer.convert_tokens_to_ids("a"))
    matcher.rollback(1)
    assert allowed(matcher, len(tokenizer)) == first


def test_json_schema_follows_a_valid_document_and_refuses_a_wrong_key(compiler, tokenizer):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"]}
    params = StructuredOutputsParams(json=schema)
    matcher = compiler.matcher(params)
    document = json.dumps({"name": "Ada", "age": 36})  # compact JSON, xgrammar's default separators
    assert all(matcher.accept(t) for t in tokenizer.encode(document))
    assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()
    wrong = compiler.matcher(params)
    accepted = [wrong.accept(t) for t in tokenizer.encode('{"nam" : 1}')]
    assert False in accepted  # the grammar stops it somewhere in the wrong key


def test_apply_bitmask_masks_exactly_the_disallowed_tokens(compiler, tokenizer):
    """Rows 0 and 2 masked (a one-token grammar and a digit regex), row 1 (no grammar) untouched: greedy
    on a row that allows one token picks it."""
    vocab_size = len(tokenizer)
    bitmask = allocate_bitmask(3, vocab_size)
    compiler.matcher(StructuredOutputsParams(choice=["7"])).fill_bitmask(bitmask, 0)
    compiler.matcher(StructuredOutputsParams(regex="[0-9]+")).fill_bitmask(bitmask, 2)
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    apply_bitmask(masked, bitmask, rows=[0, 2])
    bits = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab_size].bool()
    for row in (0, 2):
        assert torch.equal(masked[row][bits[row]], logits[row][bits[row]])
        assert torch.all(masked[row][~bits[row]] == float("-inf"))
    assert torch.equal(masked[1], logits[1])
    assert masked[0].argmax().item() == tokenizer.convert_tokens_to_ids("7") == bits[0].nonzero().item()
