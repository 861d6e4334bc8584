"""The agent's settings have one source (``config.setting``): the flags are made from it."""

from __future__ import annotations

import dataclasses

import pytest

from arl_tangram.errors import InvalidSpec
from arl_tangram.sandbox.cli import build_parser, config_from_args
from arl_tangram.sandbox.config import AgentConfig, Limits

COMMAND_OWN = {"host", "port", "token", "limits"}  # --listen and --token are the command's


def test_every_setting_has_exactly_one_flag() -> None:
    flags = []
    for cls in (AgentConfig, Limits):
        for f in dataclasses.fields(cls):
            if f.name in COMMAND_OWN:
                continue
            assert "flag" in f.metadata, f"{cls.__name__}.{f.name} has no flag"
            flags.append(f.metadata["flag"])
    assert len(flags) == len(set(flags))
    help_text = build_parser().format_help()
    assert all(flag in help_text for flag in flags)


def test_no_flags_give_the_settings_defaults() -> None:
    config = config_from_args(build_parser().parse_args([]))
    default = AgentConfig()
    for f in dataclasses.fields(AgentConfig):
        if f.name not in COMMAND_OWN | {"workdir_root"}:  # the default root names this process
            assert getattr(config, f.name) == getattr(default, f.name), f.name
    assert config.limits == Limits()


def test_each_kind_of_flag_sets_its_setting() -> None:
    args = [
        "--max-body-mb", "2.5", "--no-private-tmp", "--network-allowed", "--runtimes", "python, bash",
        "--cores", "0", "--timeout", "3", "--nproc", "9", "--fork-loop", "python", "--workdir-root", "w",
    ]  # fmt: skip
    config = config_from_args(build_parser().parse_args(args))
    assert config.max_body_bytes == int(2.5 * (1 << 20))
    assert config.private_tmp is False and config.network_allowed is True
    assert config.runtimes == ("python", "bash")
    assert config.cores == [0]
    assert config.limits.timeout_s == 3 and config.limits.nproc == 9
    assert config.fork_loop == "python"
    assert config.workdir_root.startswith("/") and config.workdir_root.endswith("/w")


def test_bad_values_name_their_flag() -> None:
    parser = build_parser()
    with pytest.raises(InvalidSpec, match="max-waiting"):
        config_from_args(parser.parse_args(["--max-waiting", "-1"]))
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parser.parse_args(["--fork-loop", "rust"])
