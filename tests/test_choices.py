"""Each option's values are written once, as a Literal in protocol/choices.py: the config field's type, the
CLI's choices, the check's message and the tables of the modules that act on them all follow it."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from tandem.kernels.ops import ATTENTION_BACKENDS
from tandem.launch.cli_options import add_engine_flags
from tandem.protocol import choices
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.serve_config import ServeConfig
from tandem.scheduler import host_tier, scheduling_policy


@pytest.mark.parametrize("cls", [EngineConfig, ServeConfig])
def test_every_literal_field_is_a_flag_with_its_values_as_choices(cls: type) -> None:
    fields = choices.field_choices(cls)
    assert fields  # each config has some
    parser = argparse.ArgumentParser()
    add_engine_flags(parser, cls)
    actions = {a.dest: a for a in parser._actions}
    model = ["--model", "m"] if cls is EngineConfig else []
    for name, values in fields.items():
        assert tuple(actions[name].choices) == values, name
        default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
        assert default is None or default in values, name
        flag = f"--{name.replace('_', '-')}"
        assert getattr(parser.parse_args([*model, flag, values[-1]]), name) == values[-1]
        with pytest.raises(SystemExit):
            parser.parse_args([*model, flag, "not-a-value"])


@pytest.mark.parametrize("name", sorted(choices.field_choices(EngineConfig)))
def test_a_value_outside_the_literal_is_refused_by_name(name: str) -> None:
    values = choices.field_choices(EngineConfig)[name]
    why = f"must be {choices.spelled(values)}"
    with pytest.raises(ValueError, match=f"invalid engine option {name}='bogus': {why}"):
        EngineConfig.from_options("m", **{name: "bogus"})
    with pytest.raises(ValueError, match=f"invalid engine option {name}='bogus': {why}"):
        EngineConfig("m", **{name: "bogus"})
    for v in values:
        assert getattr(EngineConfig.from_options("m", **{name: v}), name) == v


def test_serve_options_are_checked_alike() -> None:
    with pytest.raises(ValueError, match="invalid serve option reasoning_parser='r1': must be qwen3, deepseek-r1"):
        ServeConfig(reasoning_parser="r1")  # type: ignore[arg-type]
    assert ServeConfig(reasoning_parser="auto").reasoning_parser == "auto"


def test_the_modules_acting_on_a_value_have_one_entry_each() -> None:
    assert ATTENTION_BACKENDS == typing.get_args(choices.AttentionBackend)
    assert tuple(scheduling_policy.POLICIES) == typing.get_args(choices.SchedulingPolicyName)
    assert tuple(host_tier.POLICIES) == typing.get_args(choices.HostKVPolicy)
    for name, cls in scheduling_policy.POLICIES.items():
        assert scheduling_policy.make_policy(name).name == name and issubclass(
            cls, scheduling_policy.SchedulingPolicy)
    with pytest.raises(TypeError):  # the interface is abstract: a policy must implement it all
        scheduling_policy.SchedulingPolicy()  # type: ignore[abstract]
