"""The basics a user of the package looks for: the license text that pyproject names, and the
PEP 561 marker that makes type checkers read unisleep's annotations (shipped as package data)."""

from __future__ import annotations

import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_license_file_is_the_apache_2_text_pyproject_names():
    assert _pyproject()["project"]["license"]["text"] == "Apache-2.0"
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_py_typed_marker_exists_and_is_package_data():
    assert os.path.isfile(os.path.join(ROOT, "unisleep", "py.typed"))
    data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["unisleep"]
