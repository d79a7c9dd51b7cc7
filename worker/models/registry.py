"""config.json ``architectures[0]`` -> the model class: each protocol/architectures.py entry names its class
("module:Class" under this package), imported on first use."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import nn

from tandem.protocol.architectures import ARCHITECTURES, architecture


@functools.cache
def get_model_class(name: str | None) -> type[nn.Module]:
    """The class of an architecture (ModelLoadError for one the engine does not run)."""
    module, cls = architecture(name).model_class.split(":")
    # a family file of this package, or a dotted path (a model kept outside it)
    path = module if "." in module else f"tandem.worker.models.{module}"
    return getattr(importlib.import_module(path), cls)


def model_registry() -> dict[str, type[nn.Module]]:
    """Every architecture's class, by name."""
    return {name: get_model_class(name) for name in ARCHITECTURES}


def renamed(
    weights: Iterable[tuple[str, Any]], prefixes: Sequence[tuple[str, str]]
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's (name, tensor) pairs with the first matching prefix of (theirs, ours) swapped in; a
    name with none passes as it is."""
    for name, tensor in weights:
        for theirs, ours in prefixes:
            if name.startswith(theirs):
                name = ours + name[len(theirs) :]
                break
        yield name, tensor
