"""Every command's ``--help`` shows every option's name whole: piped and at 80 columns (click's plain help, which
wraps), and at a terminal wide enough for typer's rich panels (which cut what does not fit with "…")."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import typer
from typer.testing import CliRunner

from raytrain_eks import cli


def _commands(command: typer.core.TyperGroup | typer.core.TyperCommand, path: tuple[str, ...] = ()) -> Iterator:
    """(argv path, click command) for the app and every command and group under it."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def _option_names(command) -> list[str]:
    return [
        name
        for param in command.params
        if param.param_type_name == "option" and not getattr(param, "hidden", False)
        for name in (*param.opts, *param.secondary_opts)
    ]


COMMANDS = list(_commands(typer.main.get_command(cli.app)))


def test_the_walk_finds_nested_commands_and_their_options():
    paths = [path for path, _ in COMMANDS]
    assert ("train",) in paths and ("config", "show") in paths and len(paths) > 10
    train = dict(COMMANDS)[("train",)]
    assert {"--checkpoint-every", "--keep-checkpoints", "--no-storage-shared"} <= set(_option_names(train))


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) or "raytrain-eks" for p, _ in COMMANDS])
def test_piped_help_at_80_columns_names_every_option_whole(path, command):
    result = CliRunner().invoke(cli.app, [*path, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    missing = [name for name in _option_names(command) if name not in result.output.replace(",", " ").split()]
    assert not missing, result.output
    assert "…" not in result.output, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80, result.output


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) or "raytrain-eks" for p, _ in COMMANDS])
def test_rich_help_at_its_narrowest_terminal_names_every_option_whole(path, command, monkeypatch):
    # What a terminal exactly RICH_HELP_MIN_COLUMNS wide shows: typer's panels, which cut a cell that does not fit.
    monkeypatch.setattr(cli.app, "rich_markup_mode", "rich")
    result = CliRunner().invoke(cli.app, [*path, "--help"], env={"COLUMNS": str(cli.RICH_HELP_MIN_COLUMNS)})
    assert result.exit_code == 0, result.output
    assert "╭─ Options" in result.output or not _option_names(command)
    assert "…" not in result.output, result.output
    for name in _option_names(command):
        assert name in result.output, (name, result.output)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("tty", "columns", "mode"),
    [(True, cli.RICH_HELP_MIN_COLUMNS, "rich"), (True, 80, None), (False, 200, None)],
)
def test_rich_help_only_on_a_terminal_wide_enough(tty, columns, mode, monkeypatch):
    monkeypatch.setattr("sys.stdout", _Terminal() if tty else io.StringIO())
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.help_markup_mode() == mode


def test_plain_help_takes_a_wide_terminal_up_to_its_cap():
    # A phrase a wide terminal holds stays on one line (click alone stops at 80); lines never pass the cap.
    result = CliRunner().invoke(cli.app, ["train", "--help"], env={"COLUMNS": "200"})
    widths = [len(line) for line in result.output.splitlines()]
    assert 80 < max(widths) <= cli.PLAIN_HELP_MAX_COLUMNS, result.output
    assert "Data format: text, instruction, chat, sharegpt, openai, preference." in result.output
