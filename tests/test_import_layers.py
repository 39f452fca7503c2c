"""The packages' layers hold: `lint-imports` (import-linter) keeps every contract in pyproject.toml.

The contracts say which way imports point (cli -> job -> driver -> options ->
worker / observe -> comm / recipes / callbacks -> core / errors); a new arrow
upward, or any import of flexpar into the pure core, fails here with the
module names and the line.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lint_imports() -> list:
    """The command that runs import-linter here, or skip when it is not installed."""
    found = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if found is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]' installs it)")
    return [found]


def test_every_import_contract_is_kept():
    completed = subprocess.run([*_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "0 broken" in completed.stdout
