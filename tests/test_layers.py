"""The layers hold: `lint-imports` keeps the contracts in pyproject.toml, and the tools
people run on a serving node import neither torch nor vLLM (seconds saved, and they
work where neither is installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maru.backends.shm import shm_path
from tests.conftest import unique_name

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "vllm")

RUN_COMMAND = """\
import sys
from maru.cli import main
code = main(sys.argv[1:])
print("imported:", ",".join(m for m in {heavy!r} if m in sys.modules) or "-")
sys.exit(code)
"""


def run_maru(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`maru ARGS` in a fresh interpreter that says which heavy modules it imported."""
    return subprocess.run(
        [sys.executable, "-c", RUN_COMMAND.format(heavy=HEAVY), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


LINT_IMPORTS = """\
import sys
from importlinter.cli import lint_imports
sys.exit(lint_imports(no_logo=True, no_cache=True))
"""
"""`lint-imports` run by this interpreter (the release lanes' have no script of their own)."""


def test_the_import_contracts_hold() -> None:
    result = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["info"],
        ["config", "show"],
        ["pool", "create"],
        ["pool", "stats"],
        ["pool", "namespaces"],
        ["doctor"],
        ["bench", "--backend", "mock", "--size", "64KiB", "--capacity", "16MiB"],
        ["pool", "destroy"],
    ],
    ids=" ".join,
)
def test_the_store_tools_import_neither_torch_nor_vllm(command, shared_pool) -> None:
    result = run_maru(*command, env=shared_pool)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "imported: -", result.stdout[-2000:]


@pytest.fixture(scope="module")
def shared_pool():
    """The environment naming one small shm pool, shared by the commands in order (and
    removed at the end, whatever they did)."""
    name = unique_name("layers")
    yield {"MARU_SHM__NAME": name, "MARU_CAPACITY": "16MiB"}
    shm_path(name).unlink(missing_ok=True)


def test_every_module_logs_under_vllm_maru() -> None:
    """Inside vLLM, vLLM's log configuration must reach all of maru's lines: every logger
    comes from maru.log (the tree `vllm.maru.*`), none from logging directly."""
    import ast

    direct = []
    for path in sorted((ROOT / "maru").rglob("*.py")):
        if path.name == "log.py" and path.parent.name == "maru":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "getLogger":
                direct.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert direct == [], "use maru.log.get_logger(__name__)"
