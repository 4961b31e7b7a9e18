"""`specdec` command line."""

from __future__ import annotations

import pytest

from specdec.cli import main


def test_unknown_subcommand_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-command"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
