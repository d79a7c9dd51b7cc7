"""The values an option may take, each one `Literal`: the config dataclasses' field types, the CLI's
`choices` (launch/cli_options.py derives them) and the checks (`check_choices`) all read them here, and the
modules that act on a value (kernels/ops.py, scheduler/scheduling_policy.py, ...) key their tables by them."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDType = Literal["auto", "float32", "float16", "bfloat16", "q8_0"]
AttentionBackend = Literal["auto", "cpu", "torch", "triton"]
HostKVPolicy = Literal["write_back", "write_through"]
SchedulingPolicyName = Literal["fcfs", "priority"]
Pooling = Literal["last", "mean", "cls"]
SpeculativeMethod = Literal["ngram"]
ReasoningParserName = Literal["qwen3", "deepseek-r1", "auto"]
ModelState = Literal["unloaded", "loading", "loaded", "failed"]  # a served model's engine (/v1/models)


def literal_values(tp: Any) -> tuple[str, ...] | None:
    """The values of a Literal type (also inside `X | None`); None for any other type."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else tp
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


@functools.cache
def field_choices(cls: type) -> dict[str, tuple[str, ...]]:
    """A config dataclass's Literal fields -> their values."""
    hints = typing.get_type_hints(cls)
    return {f.name: v for f in dataclasses.fields(cls) if (v := literal_values(hints[f.name])) is not None}


def spelled(values: tuple[str, ...]) -> str:
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def check_choices(cls: type, options: typing.Mapping[str, object], what: str) -> None:
    """Raises ValueError naming the first option whose string value is not one of its field's values."""
    for name, values in field_choices(cls).items():
        v = options.get(name)
        if isinstance(v, str) and v not in values:
            raise ValueError(f"invalid {what} option {name}={v!r}: must be {spelled(values)}")
