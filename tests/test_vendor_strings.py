"""No file of unisleep/ names a vendor in a string literal: vendor names live in backends/, in
each backend package's descriptor and modules.

Everything in unisleep/ asks the platform's descriptor (driver, collective, torch device type),
so a vendor name in a literal there is a leak of vendor logic into vendor-neutral code.  Docstrings
and comments may mention vendors.  Words are matched case-insensitively between non-alphanumeric
boundaries, so ``"torch.cuda"``, ``"cuda:0"`` and ``"PYTORCH_CUDA_ALLOC_CONF"`` are leaks while
``"chip"`` or ``"oracle"`` are not.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "unisleep")
ALLOWED: set[str] = set()  # none: platform.py is the loop over the descriptors
VENDOR_WORDS = ("cuda", "nccl", "npu", "hccl", "rccl", "hip", "rocm", "ascend", "acl")
VENDOR_RE = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(VENDOR_WORDS) + r")(?![A-Za-z0-9])", re.IGNORECASE)


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                ids.add(id(body[0].value))
    return ids


def vendor_strings(source: str, filename: str = "<string>") -> list[tuple[int, str, str]]:
    """(line, vendor word, literal) for each vendor word in a non-docstring string literal.
    Literal parts of f-strings count; the expressions inside them are code, not literals."""
    tree = ast.parse(source, filename)
    docs = _docstring_nodes(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and id(node) not in docs:
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            for m in VENDOR_RE.finditer(text):
                hits.append((node.lineno, m.group(1), text if len(text) < 80 else text[:77] + "..."))
    return hits


def package_files() -> list[str]:
    out = []
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return sorted(out)


# ---------------------------------------------------------------------------- the checker can fail
@pytest.mark.parametrize(
    "src,words",
    [
        ('x = "nccl"\n', ["nccl"]),
        ('x = f"use {backend} on CUDA device"\n', ["CUDA"]),
        ("x = 'cuda:0'\n", ["cuda"]),
        ('x = "PYTORCH_CUDA_ALLOC_CONF"\n', ["CUDA"]),
        ('def f():\n    return {"hccl": 1, "npu": "torch.npu"}\n', ["hccl", "npu", "npu"]),
        ('x = b"rocm"\n', ["rocm"]),
        ('x = ("a " "hip")\n', ["hip"]),
        ('class A:\n    """Docstring."""\n    y = "Ascend ACL graph"\n', ["Ascend", "ACL"]),
    ],
)
def test_checker_finds_leaks(tmp_path, src, words):
    f = tmp_path / "leak.py"
    f.write_text(src)
    assert [w for _, w, _ in vendor_strings(f.read_text(), str(f))] == words


@pytest.mark.parametrize(
    "src",
    [
        '"""Module docstring naming CUDA, NCCL, HCCL and ROCm is fine."""\nx = 1\n',
        'def f():\n    """Works on cuda and npu."""\n    return 0  # comments may say nccl\n',
        'x = "chip relationship oracle input acls hipster"\n',
        'x = f"{torch.cuda.is_available()}"\n',  # code inside an f-string is not a literal
        "cuda = 1\nnccl = cuda + 1\n",  # identifiers are not string literals
    ],
)
def test_checker_allows(src):
    assert vendor_strings(src) == []


def test_checker_on_a_file_like_the_package(tmp_path):
    pkg = tmp_path / "unisleep_like"
    pkg.mkdir()
    (pkg / "ok.py").write_text('"""Talks about CUDA."""\nBACKEND = platform.collective_backend\n')
    (pkg / "bad.py").write_text('x = "nccl"\n')
    found = {p.name: vendor_strings(p.read_text()) for p in pkg.iterdir()}
    assert found["ok.py"] == [] and found["bad.py"] == [(1, "nccl", "nccl")]


# ---------------------------------------------------------------------------- the package itself
def test_package_has_files_to_check():
    files = package_files()
    assert os.path.join(PACKAGE, "lifecycle", "memory.py") in files and len(files) >= 8


def test_no_vendor_strings_outside_platform():
    leaks = []
    for path in package_files():
        if path in ALLOWED:
            continue
        with open(path, encoding="utf-8") as f:
            src = f.read()
        for line, word, text in vendor_strings(src, path):
            leaks.append(f"{os.path.relpath(path, ROOT)}:{line}: {word!r} in {text!r}")
    assert not leaks, "vendor names in string literals in unisleep/ (they belong in backends/):\n" + "\n".join(leaks)


def test_checker_sees_the_vendor_names_where_they_live():
    """The backends' descriptors and collectives name their vendors: the checker must see them."""
    words = set()
    for rel in ("cuda/descriptor.py", "rocm/descriptor.py", "ascend/descriptor.py", "cuda/collective.py",
                "ascend/collective.py"):
        path = os.path.join(ROOT, "backends", rel)
        with open(path, encoding="utf-8") as f:
            words |= {w.lower() for _, w, _ in vendor_strings(f.read(), path)}
    assert {"cuda", "hip", "npu", "nccl", "hccl"} <= words
