"""docs/api.md is what the source says: every exported name of the user-facing modules with its
signature and the first paragraph of its docstring (tools/api_reference.py writes it)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import api_reference  # noqa: E402


def test_the_api_page_matches_the_source():
    with open(api_reference.PAGE, encoding="utf-8") as f:
        page = f.read()
    assert page == api_reference.render(), "docs/api.md is out of date: run python tools/api_reference.py"


def test_every_exported_name_is_on_the_page():
    page = api_reference.render()
    for module, _ in api_reference.MODULES:
        names = api_reference.exported(api_reference.parse(module))
        assert names, f"{module} exports nothing (__all__)"
        section = page.split(f"\n## {module}\n", 1)[1].split("\n## ", 1)[0]
        missing = [n for n in names if f"`{n}" not in section]
        assert not missing, (module, missing)


def test_the_check_can_fail(tmp_path, monkeypatch):
    stale = tmp_path / "api.md"
    stale.write_text("# API reference\n")
    monkeypatch.setattr(api_reference, "PAGE", str(stale))
    assert api_reference.main(["--check"]) == 1
    api_reference.main([])
    assert api_reference.main(["--check"]) == 0
