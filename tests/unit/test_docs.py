"""The docs keep up with the CLI, in the manner of sqlite-utils' tests/test_docs.py: every
`tunecache` command and subcommand is documented in README.md or docs/*.md (as `tunecache
COMMAND ...`), and every command the docs show exists. The settings' half of this is
tests/unit/test_settings.py (every TUNECACHE_* variable of tunecache/settings.py is in a table)."""

from __future__ import annotations

import re

import pytest
import typer

from support import ROOT
from tunecache.cli import app

DOCS = {
    p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}


def _commands(group, path: tuple[str, ...] = ()):
    for name, cmd in group.commands.items():
        if cmd.hidden:
            continue
        if getattr(cmd, "commands", None):  # a sub-app: token, jobs, db, ...
            yield from _commands(cmd, (*path, name))
        else:
            yield " ".join((*path, name))


COMMANDS = sorted(_commands(typer.main.get_command(app)))


def test_the_walk_finds_the_sub_apps():
    assert {"tune", "compile", "db upgrade", "token create", "jobs retry", "fleet purge", "audit ls"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_is_documented(command):
    shown = re.compile(rf"\btunecache {re.escape(command)}(?![\w-])")
    assert any(shown.search(text) for text in DOCS.values()), (
        f"`tunecache {command}` is in no doc: say in README.md or docs/*.md what it does, with an example"
    )


def test_every_command_the_docs_show_exists():
    # in code (`...` and ``` blocks), `tunecache WORD [WORD]` must be a command or a sub-app's
    groups = {c.split()[0] for c in COMMANDS if " " in c}
    code = re.compile(r"```.*?```|`[^`\n]+`", re.S)
    called = re.compile(r"(?<![\w./-])tunecache ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?")
    unknown = set()
    for name, text in DOCS.items():
        for block in code.findall(text):
            for first, second in called.findall(block):
                command = f"{first} {second}" if first in groups and second else first
                if command not in COMMANDS and command not in groups:
                    unknown.add(f"{name}: tunecache {command}")
    assert not unknown, f"the docs show commands the CLI does not have: {sorted(unknown)}"
