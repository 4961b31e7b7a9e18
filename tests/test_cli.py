"""`specdec` command line: services add their subcommands by entry point."""

from __future__ import annotations

import pytest

from specdec.cli import main


def test_the_gateway_registers_profile(capsys):
    # specdec imports no service: `profile` reaches the CLI only through the
    # `specdec.commands` entry point the gateway declares in pyproject.toml.
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert "specdec profile" in usage and "--batch-sizes" in usage and "--verifier" in usage


def test_unknown_subcommand_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-command"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
