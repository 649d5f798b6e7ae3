"""Release bookkeeping: the changelog has a section for the version in pyproject.toml, and ``tilela.__version__``
is the installed distribution's version."""

import re
from importlib import metadata
from pathlib import Path

import pytest

import tilela

ROOT = Path(__file__).resolve().parents[1]


def test_changelog_has_unreleased_and_the_project_version():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings[0] == "Unreleased" and version in headings, (
        f"CHANGELOG.md: expected '## Unreleased' first and a '## {version}' section, got {headings}")


def test_version_is_the_installed_distribution():
    try:
        installed = metadata.version("tilela")
    except metadata.PackageNotFoundError:
        pytest.skip("tilela is not installed (a bare source tree reports 0+unknown)")
    assert tilela.__version__ == installed
