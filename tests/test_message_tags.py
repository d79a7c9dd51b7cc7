"""One name per message: every tagged struct in protocol/ has a tag of its own, so a frame's `type` names one
message whichever socket it crossed (a drain's request and its run once shared "drain")."""

from __future__ import annotations

import collections
import importlib
import pkgutil

import msgspec

import tandem.protocol as protocol


def test_every_message_tag_names_one_message() -> None:
    owners: dict[str, set[str]] = collections.defaultdict(set)
    for info in pkgutil.iter_modules(protocol.__path__):
        module = importlib.import_module(f"tandem.protocol.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__struct_config__.tag:
                owners[str(obj.__struct_config__.tag)].add(obj.__qualname__)
    assert len(owners) > 20  # the walk found the messages
    assert {tag: names for tag, names in owners.items() if len(names) > 1} == {}
