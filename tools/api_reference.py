"""Write docs/api.md, the API reference, from the source: for each user-facing module, the names in
its ``__all__``, each with its signature and the first paragraph of its docstring (a class: its
public methods and properties too).

Read statically (``ast``), so nothing is imported: the reference is the same on every machine,
whatever torch, vLLM or framework is installed.  ``python tools/api_reference.py`` rewrites the
page; ``--check`` exits 1 when the page differs from what the source gives (tests/test_api_reference.py
runs it, so a changed signature or docstring without the page regenerated fails the tests).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "api.md")

#: the modules a user imports, in the order the page shows them, each with one line on what it is for
MODULES = [
    ("unisleep", "the lifecycle, the platform, the errors"),
    ("unisleep.errors", "every error unisleep raises; each message names the fix"),
    ("unisleep.lifecycle", "the tag states and levels beside `MemoryLifecycle`"),
    ("unisleep.transfer", "weight transfer: groups, senders, receivers, reports"),
    ("unisleep.loop", "the guarded RL step against an engine"),
    ("unisleep.logprob_gap", "the engine-versus-trainer logprob monitor"),
    ("unisleep.engines.torch_generator", "the embedded engine"),
    ("unisleep.engines.vllm_http", "a vLLM server driven over its development routes"),
    ("unisleep.engines.vllm_inprocess", "a vLLM `LLM` in this process"),
    ("unisleep.engines.vllm_async", "vLLM's `AsyncLLM` in this process"),
    ("unisleep.engines.vllm_server", "starting a vLLM server on loopback"),
    ("unisleep.engines.vllm_trainer", "the trainer side of a vLLM weight update"),
    ("unisleep.compat", "the torch_memory_saver drop-in"),
    ("unisleep.extra_cleanup", "collective teardown/restore and graph recapture around a sleep"),
    ("unisleep.ray", "a transfer group between Ray actors"),
    ("unisleep.integrations.verl", "verl's checkpoint engine"),
    ("unisleep.integrations.openrlhf", "OpenRLHF's weight sync"),
    ("unisleep.integrations.trl", "TRL's server-mode client"),
    ("unisleep.integrations.skyrl", "SkyRL's weight-transfer strategy"),
    ("unisleep.integrations.sglang", "SGLang's weight updates"),
    ("unisleep.integrations.slime", "slime's offload"),
    ("unisleep.integrations.areal", "AReaL's offload"),
    ("unisleep.registry", "registering a backend"),
    ("unisleep.platform", "platform detection"),
]


def module_file(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["unisleep", "backends"]:
        parts = ["backends"] + parts[2:]
    base = os.path.join(ROOT, *parts)
    return os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"


def parse(name: str) -> ast.Module:
    with open(module_file(name), encoding="utf-8") as f:
        return ast.parse(f.read(), filename=module_file(name))


def exported(tree: ast.Module) -> list[str]:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def resolve(module: str, tree: ast.Module, name: str, depth: int = 0):
    """(the module that defines ``name``, its node) following ``from .x import name``; the node is
    None for a name bound another way (a constant, a submodule)."""
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return module, node
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return module, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and depth < 5:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    pkg = module if module_file(module).endswith("__init__.py") else module.rsplit(".", 1)[0]
                    for _ in range(max(node.level - 1, 0)):
                        pkg = pkg.rsplit(".", 1)[0]
                    src = node.module if node.level == 0 else (f"{pkg}.{node.module}" if node.module else pkg)
                    if not src.startswith("unisleep"):
                        return src, None
                    if not node.module or not os.path.exists(module_file(src)):  # a submodule
                        return f"{src}.{alias.name}", None
                    return resolve(src, parse(src), alias.name, depth + 1)
    return module, None


def first_paragraph(node) -> str:
    doc = ast.get_docstring(node) or ""
    para = doc.split("\n\n", 1)[0]
    para = re.sub(r":[a-z]+:`~?\.?([^`<]*?)(?:\s*<[^>]*>)?`", r"`\1`", para)  # :meth:`x`, :class:`~a.b`
    return " ".join(para.split()).replace("``", "`")


def signature(node) -> str:
    args = ast.unparse(node.args)
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"({args}){ret}"


def is_property(fn) -> bool:
    return any(isinstance(d, ast.Name) and d.id in ("property", "cached_property")
               or isinstance(d, ast.Attribute) and d.attr in ("setter",) for d in fn.decorator_list)


def render_class(node: ast.ClassDef) -> list[str]:
    bases = ", ".join(ast.unparse(b) for b in node.bases)
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    sig = signature(init).replace("(self, ", "(").replace("(self)", "()") if init else ""
    lines = [f"### class `{node.name}{sig}`" + (f" ({bases})" if bases else ""), ""]
    text = first_paragraph(node)
    if text:
        lines += [text, ""]
    members = []
    for n in node.body:
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) or n.name.startswith("_"):
            continue
        if any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in n.decorator_list):
            continue
        head = f"`{n.name}`" if is_property(n) else \
            f"`{'async ' if isinstance(n, ast.AsyncFunctionDef) else ''}{n.name}{signature(n)}`".replace("(self, ", "(").replace("(self)", "()").replace("(cls, ", "(").replace("(cls)", "()")
        text = first_paragraph(n)
        members.append(f"- {head}" + (f" — {text}" if text else ""))
    return lines + members + ([""] if members else [])


def render() -> str:
    out = ["# API reference", "",
           "The names each user-facing module exports, with their signatures and the first paragraph of",
           "their docstrings. Written from the source by `python tools/api_reference.py` (the tests fail",
           "when this page and the source disagree). Guides: [lifecycle.md](lifecycle.md),",
           "[transfer.md](transfer.md), [rl-loop.md](rl-loop.md), [vllm.md](vllm.md), the",
           "[integrations](integrations/); measured figures: [benchmarks.md](benchmarks.md).", ""]
    out += [f"- [`{m}`](#{m.replace('.', '')}) — {what}" for m, what in MODULES] + [""]
    shown: dict[tuple[str, str], str] = {}  # (defining module, name) -> the section that shows it
    for module, what in MODULES:
        tree = parse(module)
        out += [f"## {module}", "", f"{what[0].upper()}{what[1:]}.", ""]
        doc = first_paragraph(tree)
        if doc:
            out += [doc, ""]
        constants = []
        for name in exported(tree):
            src, node = resolve(module, tree, name)
            where = f" (from `{src}`)" if src != module else ""
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if (src, name) in shown:
                    first = shown[(src, name)]
                    constants.append(f"`{name}` ([{first}](#{first.replace('.', '')}))")
                    continue
                shown[(src, name)] = module
            if isinstance(node, ast.ClassDef):
                lines = render_class(node)
                out += lines[:2] + ([f"Defined in `{src}`.", ""] if where else []) + lines[2:]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                text = first_paragraph(node)
                out += [f"### `{name}{signature(node)}`", ""] + ([f"Defined in `{src}`.", ""] if where else []) \
                    + ([text, ""] if text else [])
            else:
                constants.append(f"`{name}`{where}")
        if constants:
            out += ["Also: " + ", ".join(constants) + ".", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/api.md differs from the source")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(PAGE, encoding="utf-8") as f:
            if f.read() != text:
                print("docs/api.md is out of date with the source: run python tools/api_reference.py", file=sys.stderr)
                return 1
        return 0
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(PAGE, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
