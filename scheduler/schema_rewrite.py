"""JSON schemas rewritten before xgrammar compiles them, around a bug of xgrammar 0.2.9.

A string schema with minLength/maxLength compiles to a rule that admits raw control characters and no
escapes (mlc-ai/xgrammar#800), so the output is not JSON. Such a string becomes a `pattern` of
{min,max} characters other than `"`, `\\` and controls: xgrammar compiles a pattern over the string's
characters (code points), and that class needs no escaping, so the text is JSON and its decoded length
is in bounds. The price: a length-bounded string cannot hold a quote, a backslash or a control character.
"""
from __future__ import annotations

import json
from typing import Any

_PLAIN_CHAR = r'[^"\\\x00-\x1f]'
# Keys whose values are data, not subschemas: never rewritten.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
# A string with one of these is already narrowed another way; left to xgrammar as it is.
_NARROWED = frozenset({"pattern", "format", "enum", "const"})


def _is_length_bounded_string(node: dict[str, Any]) -> bool:
    # Bounds that are not integers are left for the compiler to report as written.
    bounds = [node[k] for k in ("minLength", "maxLength") if k in node]
    return (
        node.get("type") == "string"
        and bool(bounds)
        and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in bounds)
        and not _NARROWED & node.keys()
    )


def _rewrite(node: Any) -> Any:
    if isinstance(node, list):
        return [_rewrite(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _DATA_KEYS else _rewrite(v)) for k, v in node.items()}
    if _is_length_bounded_string(out):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_PLAIN_CHAR}{{{lo},{hi}}}$"
    return out


def rewrite_schema_text(text: str) -> str:
    """The schema document with every length-bounded string rewritten; unparsable text unchanged (the
    compiler reports it)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(_rewrite(schema), ensure_ascii=False)
