"""What a request's output must match (vLLM's `StructuredOutputsParams`): a JSON schema, any JSON
object, a regular expression, one of a few strings, or a grammar. Each becomes a grammar
(`grammar_source`), which `nanoserve/structured_output/grammar.py` compiles into a per-step token
mask with xgrammar (`pip install 'nanoserve[structured]'`).
"""
import json
import re
from dataclasses import dataclass, fields

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Set exactly one field. A bad spec is a ValueError naming its field, raised here, before any
    work."""

    json: dict | str | None = None  # a JSON schema (a dict or its JSON text)
    json_object: bool | None = None  # True: any JSON object
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF, as llama.cpp's) with a `root` rule

    def __post_init__(self) -> None:
        chosen = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(KINDS)}; got "
                             f"{' and '.join(chosen) or 'none'}")
        (kind,) = chosen
        value = getattr(self, kind)
        expected = {"json": (dict, str), "json_object": bool,
                    "regex": str, "choice": list, "grammar": str}[kind]
        if (not isinstance(value, expected)
                or kind == "choice" and not all(isinstance(c, str) for c in value)):
            raise ValueError(f"structured_outputs.{kind}: wrong type {type(value).__name__}")
        if kind == "choice" and not value:
            raise ValueError("structured_outputs.choice: needs at least one string")
        if kind == "json" and isinstance(value, str):
            try:
                self.json = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from e
        check_grammar(kind, *self.grammar_source())

    def grammar_source(self) -> tuple[str, str]:
        """(how to compile, what): ("json", schema text), ("json_object", ""), ("regex", r) or
        ("ebnf", g). Equal specs give equal sources, so a compile cache can key on it (a schema's
        key order is kept: the output's keys come in the order of its properties)."""
        if self.json is not None:
            return "json", json.dumps(self.json)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            # one alternative per string; JSON's string escapes are EBNF's too
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return "ebnf", "root ::= " + alternatives
        return "ebnf", self.grammar


def check_grammar(kind: str, source_kind: str, source: str) -> None:
    """Let xgrammar parse the spec (without a tokenizer: cheap), so a bad one fails at the request's
    door."""
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise ValueError(f"structured_outputs.{kind}: needs xgrammar: pip install "
                         "'nanoserve[structured]'") from e
    parse = {"json": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex,
             "ebnf": xgr.Grammar.from_ebnf, "json_object": lambda _: None}[source_kind]
    try:
        parse(source)
    except RuntimeError as e:
        # "[time] /project/cpp/file.cc:83: Regex parsing error at ...": keep the message
        prefix = r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?"
        message = re.sub(prefix, "", str(e)).strip()
        raise ValueError(f"structured_outputs.{kind}: {message}") from e
