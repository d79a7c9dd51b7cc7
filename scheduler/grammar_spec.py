"""Which constraint a structured-output request has (its compile-cache key), and the client's error for a bad
one. Free of torch and xgrammar, so the scheduler thread can read a request's constraint while the grammar
machinery is still loading in the background."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]


class GrammarError(ValueError):
    """The request's constraint is invalid (bad schema, regex or grammar): a client error."""


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint. `text` is the schema document / regex / EBNF / JSON list of choices
    ("" for json_object); (kind, text) is the compile-cache key."""

    kind: GrammarKind
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)

    @classmethod
    def from_fields(
        cls,
        json_schema: str | dict[str, Any] | None = None,
        json_object: bool = False,
        regex: str | None = None,
        grammar: str | None = None,
        choice: Sequence[str] | None = None,
    ) -> GrammarSpec | None:
        """The spec for SamplingParams-style fields; None when unconstrained. At most one may be set."""
        given = [
            json_schema is not None,
            json_object,
            regex is not None,
            grammar is not None,
            choice is not None,
        ]
        if sum(given) > 1:
            raise GrammarError("give at most one of json_schema, json_object, regex, grammar, choice")
        if json_schema is not None:
            # Not re-serialised when already a string: property order drives generation order, and an
            # unparsable document should fail in the compiler with its own message.
            text = (
                json_schema if isinstance(json_schema, str) else json.dumps(json_schema, ensure_ascii=False)
            )
            return cls("json_schema", text)
        if json_object:
            return cls("json_object", "")
        if regex is not None:
            return cls("regex", regex)
        if grammar is not None:
            return cls("grammar", grammar)
        if choice is not None:
            return cls("choice", json.dumps(list(choice), ensure_ascii=False))
        return None

    @classmethod
    def from_params(cls, params: Any) -> GrammarSpec | None:
        """From any object with the SamplingParams field names (missing ones count as unset)."""
        return cls.from_fields(
            json_schema=getattr(params, "json_schema", None),
            json_object=bool(getattr(params, "json_object", False)),
            regex=getattr(params, "regex", None),
            grammar=getattr(params, "grammar", None),
            choice=getattr(params, "choice", None),
        )

    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return json.loads(self.text)


def _ebnf_literal(s: str) -> str:
    """A GBNF string literal matching exactly `s`."""
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        elif 0xD800 <= ord(ch) <= 0xDFFF:
            raise GrammarError(f"choice {s!r} contains a lone surrogate (not valid Unicode text)")
        else:
            out.append(f"\\U{ord(ch):08X}")  # control and non-ASCII characters, unambiguous
    out.append('"')
    return "".join(out)


def choice_ebnf(choices: Sequence[str]) -> str:
    if not choices:
        raise GrammarError("choice must list at least one string")
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)
