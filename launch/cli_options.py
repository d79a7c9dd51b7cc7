"""Command-line flags -> EngineConfig (and ServeConfig). The dataclass is the one source of names and
defaults;
frontend/client/engine_process.py writes a config back as flags."""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from tandem.protocol.choices import literal_values
from tandem.protocol.engine_config import EngineConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> type:
    if isinstance(tp, (types.UnionType,)) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_engine_flags(
    parser: argparse.ArgumentParser, cls: type = EngineConfig, many_models: bool = False
) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        help_ = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name == "model" and many_models:
            parser.add_argument(
                "--model", action="append", help="model: a Hugging Face directory, a .gguf file or a name "
                "tandem pull knows (pulled when absent); give it several times to serve several models"
            )
        elif f.name == "model":
            parser.add_argument(
                "--model", required=True, help="model: a Hugging Face directory or a .gguf file"
            )
        elif typing.get_origin(tp) is list and f.metadata.get("nargs"):  # items after one flag, or several
            parser.add_argument(_flag(f.name), action="extend", nargs=f.metadata["nargs"],
                                type=typing.get_args(tp)[0], help=help_)
        elif typing.get_origin(tp) is list:  # the flag given once per item
            parser.add_argument(_flag(f.name), action="append", type=typing.get_args(tp)[0], help=help_)
        elif tp is bool:
            parser.add_argument(
                _flag(f.name), action=argparse.BooleanOptionalAction, default=default, help=help_
            )
        elif (choices := literal_values(tp)) is not None:  # the values the field's Literal names
            parser.add_argument(
                _flag(f.name), choices=choices, default=default, help=f"{help_} (default: {default})"
            )
        else:
            parser.add_argument(_flag(f.name), type=tp, default=default, help=f"{help_} (default: {default})")
    if cls is EngineConfig:
        parser.add_argument("--tp", dest="tp_size", type=int, help="alias of --tp-size")


def config_from_args(args: argparse.Namespace, cls: type = EngineConfig) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if isinstance(given.get("model"), list):  # serve's --model, which may be given several times
        if len(given["model"]) != 1:
            raise ValueError(f"one model expected, got {len(given['model'])}")
        given["model"] = given["model"][0]
    return cls(**given)

