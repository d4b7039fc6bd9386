"""Every Python file of the project (package, tools, examples, tests) names only what it defines or
imports: pyflakes' undefined names that the file binds nowhere (a lost import, a renamed function),
which importing the file does not reveal when the name sits in a function only a GPU run reaches.
Names bound somewhere in the file are left to the tests that run it (pyflakes' flow rules flag some
loop-carried and closure uses that are correct). The check is shown failing on a planted file."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("pyflakes")
from pyflakes import api, messages, reporter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
UNDEFINED = (messages.UndefinedName, messages.UndefinedExport, messages.UndefinedLocal)


def bound_names(source: str) -> set[str]:
    """Every name the file binds anywhere: assignments, definitions, parameters, imports, handlers."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


class _Collect(reporter.Reporter):
    def __init__(self, bound: set[str]):
        self.bound, self.found = bound, []

    def flake(self, message):
        if isinstance(message, UNDEFINED) and message.message_args[0] not in self.bound:
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")


def python_files() -> list[Path]:
    files = [p for folder in ("qattn", "tools", "examples", "tests") for p in sorted((ROOT / folder).rglob("*.py"))]
    scripts = [p for p in sorted((ROOT / "tools").iterdir())
               if p.is_file() and p.suffix == "" and p.read_bytes().startswith(b"#!/usr/bin/env python")]
    return files + scripts


def undefined_names(path: Path) -> list[str]:
    source = path.read_text()
    found = _Collect(bound_names(source))
    api.check(source, str(path), found)
    return found.found


def test_no_undefined_names():
    files = python_files()
    assert len(files) > 50 and any(p.name == "parity" for p in files)
    problems = [line for path in files for line in undefined_names(path)]
    assert not problems, "\n".join(problems)


def test_check_finds_a_planted_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    return call_spec(1)\n")
    assert any("call_spec" in line for line in undefined_names(planted))
