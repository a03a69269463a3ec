"""The layering holds, read from the code's own imports (every ``import`` statement, also those
inside functions: a lazy import for start-up cost is fine, a lazy import that hides a circle is a
circle): no import circle among the modules of unisleep/ and backends/, backends/ imports nothing
above the driver layer (docs/lifecycle.md, "Writing a backend"), and nothing a backend imports
reaches the registry (which loads the backends by name: a circle no ``import`` statement shows),
and no module re-exports what it imports (callers import the real name), except the public
aliases listed in ``unisleep/__init__.py``'s docstring.

This is the rule for how code is cut into modules — one concern per module, whatever its length
(docs/architecture.md) — not a line count."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what a backend may import of unisleep: the errors and units, the driver contract and its
#: shared pieces, the descriptor types and registry, the graph-capture gate, the keyed digest the
#: drivers compute, release behind a sleep, address helpers, the host's memory limits and NUMA
#: placement, this user's private run directory, directories no other user can steer — and the
#: backends themselves
DRIVER_LAYER = {
    "unisleep", "unisleep.errors", "unisleep.units", "unisleep.region", "unisleep.driver", "unisleep.backup",
    "unisleep.backend", "unisleep.registry", "unisleep.graph_capture", "unisleep.keyed_hash",
    "unisleep.release_behind", "unisleep.addresses", "unisleep.hostmem", "unisleep.numa", "unisleep.private_dir",
    "unisleep.trusted_dirs", "unisleep.backup_encoding",
}


def module_name(path: str) -> str:
    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if parts[0] == "backends":
        parts = ["unisleep", "backends"] + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(root: str = ROOT) -> dict[str, str]:
    out = {}
    for top in ("unisleep", "backends"):
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    out[module_name(path) if root == ROOT else _rel_name(root, path)] = path
    return out


def _rel_name(root: str, path: str) -> str:
    parts = os.path.relpath(path, root)[:-3].split(os.sep)
    if parts[0] == "backends":
        parts = ["unisleep", "backends"] + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of the project it imports (a name imported from a package counts as
    its submodule when there is one, else as the package)."""
    graph = {}
    for name, path in mods.items():
        base = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = base.split(".")
                    pkg = pkg[: len(pkg) - node.level + 1]
                    target = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    target = node.module
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    deps.add(sub if sub in mods else target)
        out = set()
        for d in deps:
            while d and d not in mods:
                d = d.rpartition(".")[0]
            if d and d != name:
                out.add(d)
        graph[name] = out
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_walk_finds_imports_and_circles(tmp_path):
    """The checks can fail: a made-up tree with a circle and a backend importing the lifecycle."""
    (tmp_path / "unisleep" / "lifecycle").mkdir(parents=True)
    (tmp_path / "backends" / "x").mkdir(parents=True)
    files = {
        "unisleep/__init__.py": "",
        "unisleep/a.py": "from . import b\n",
        "unisleep/b.py": "def f():\n    from .a import g\n",
        "unisleep/lifecycle/__init__.py": "",
        "backends/__init__.py": "",
        "backends/x/__init__.py": "",
        "backends/x/driver.py": "from unisleep.lifecycle import MemoryLifecycle\nfrom unisleep import errors\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    mods = modules(str(tmp_path))
    graph = imports(mods)
    assert circles(graph) == [["unisleep.a", "unisleep.b"]]
    assert graph["unisleep.backends.x.driver"] == {"unisleep.lifecycle", "unisleep"}


def test_no_import_circles():
    found = circles(imports(modules()))
    assert not found, "modules that import each other (break the circle: move what both need below them):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_backends_import_nothing_above_the_driver_layer():
    graph = imports(modules())
    above = []
    for name, deps in sorted(graph.items()):
        if not name.startswith("unisleep.backends"):
            continue
        for d in sorted(deps):
            if not d.startswith("unisleep.backends") and d not in DRIVER_LAYER:
                above.append(f"{name} -> {d}")
    assert not above, "backends/ imports above the driver layer:\n" + "\n".join(above)


def below(graph: dict[str, set[str]], roots) -> set[str]:
    """Every module reachable from ``roots`` through ``graph`` (the roots included)."""
    seen, todo = set(), list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


#: the modules that look backends up by name (so load a backend's modules without an ``import``)
LOOKS_UP_BACKENDS = {"unisleep.registry", "unisleep.platform"}


def test_the_closure_check_can_fail(tmp_path):
    (tmp_path / "unisleep").mkdir()
    (tmp_path / "backends" / "x").mkdir(parents=True)
    files = {
        "unisleep/__init__.py": "",
        "unisleep/registry.py": "",
        "unisleep/digest.py": "def kernel():\n    from .registry import backends\n",
        "backends/__init__.py": "",
        "backends/x/__init__.py": "",
        "backends/x/kernel.py": "from unisleep.digest import kernel\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    graph = imports(modules(str(tmp_path)))
    reached = below(graph, [m for m in graph if m.startswith("unisleep.backends")])
    assert reached & LOOKS_UP_BACKENDS == {"unisleep.registry"}


def test_nothing_a_backend_imports_looks_backends_up():
    """A module that backends import and that finds a backend's module through the registry
    is a circle hidden from the import walk (e.g. a digest asking the registry for the backend's
    kernel, which imports the digest): what a module below the backends needs from them is handed
    down to it (an argument, or installed by the layer above), not looked up."""
    graph = imports(modules())
    backends = [m for m in graph if m.startswith("unisleep.backends")]
    wrong = []
    for m in sorted(below(graph, backends) - set(backends)):
        hit = graph[m] & LOOKS_UP_BACKENDS
        if hit and m not in LOOKS_UP_BACKENDS:
            wrong.append(f"{m} -> {', '.join(sorted(hit))}")
    assert not wrong, "modules below the backends that look backends up:\n" + "\n".join(wrong)


def _target(base: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = base.split(".")
    pkg = pkg[: len(pkg) - node.level + 1]
    return ".".join(pkg + ([node.module] if node.module else []))


def reexports(mods: dict[str, str], allowed=frozenset(), root: str = ROOT) -> list[str]:
    """Names a module imports and never uses itself that another module, a test or a tool imports
    from it (or a ``from ... import *``): a re-export, so the caller should import the real
    module.  Packages' ``__init__`` (their public names) and the ``allowed`` modules are not
    counted."""
    trees = {n: ast.parse(open(p, encoding="utf-8").read(), p) for n, p in mods.items()}
    passed_on: dict[str, set[str]] = {}
    for name, tree in trees.items():
        if mods[name].endswith("__init__.py") or name in allowed:
            continue
        base = name.rpartition(".")[0]
        imported = {}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module != "__future__" and _target(base, node) in mods:
                for a in node.names:
                    imported[a.asname or a.name] = a.name
        in_all = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                in_all = {id(x) for x in ast.walk(node)}
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in in_all}
        used |= {w for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and id(n) not in in_all for w in n.value.replace(".", " ").replace("[", " ").split()}  # annotations
        passed_on[name] = {k for k in imported if k not in used}
    importers = {n: (t, n if mods[n].endswith("__init__.py") else n.rpartition(".")[0]) for n, t in trees.items()}
    for top in ("tests", "tools"):
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__" and not x.startswith("vllm_pkg")]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    try:
                        importers[os.path.relpath(path, root)] = (ast.parse(open(path, encoding="utf-8").read()), "")
                    except SyntaxError:  # a file of another Python (a fetched package's test data): not ours
                        pass
    out = []
    for name, (tree, base) in importers.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = _target(base, node)
            for a in node.names:
                if a.name == "*" and src in mods and name in passed_on:
                    out.append(f"{name} re-exports everything of {src}")
                elif a.name in passed_on.get(src, ()):
                    out.append(f"{name} imports {a.name} from {src}")
    return sorted(set(out))


def public_aliases() -> set[str]:
    """The modules ``unisleep/__init__.py``'s docstring lists as public aliases."""
    import re

    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "unisleep", "__init__.py"), encoding="utf-8").read()))
    return set(re.findall(r"^\* ``(unisleep[.\w]+)``", doc, re.M))


def test_the_reexport_check_can_fail(tmp_path):
    (tmp_path / "unisleep").mkdir()
    files = {
        "unisleep/__init__.py": "from .real import thing\n",  # a package's public names: fine
        "unisleep/real.py": "def thing():\n    pass\n",
        "unisleep/stub.py": "from .real import thing\n",  # imported, never used here
        "unisleep/user.py": "from .real import thing\n\nthing()\n",  # uses it: fine
        "unisleep/caller.py": "def f():\n    from unisleep.stub import thing\n",
        "tests/test_x.py": "from unisleep.stub import thing\n",
        "unisleep/alias.py": "from .real import *\n",
    }
    (tmp_path / "tests").mkdir()
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    mods = modules(str(tmp_path))
    assert reexports(mods, root=str(tmp_path)) == [
        "tests/test_x.py imports thing from unisleep.stub", "unisleep.alias re-exports everything of unisleep.real",
        "unisleep.caller imports thing from unisleep.stub"]
    assert reexports(mods, allowed={"unisleep.alias", "unisleep.stub"}, root=str(tmp_path)) == []


def test_no_reexports_outside_the_public_aliases():
    aliases = public_aliases()
    assert "unisleep.vllm_plugin" in aliases  # the list is read
    found = reexports(modules(), allowed=aliases)
    assert not found, ("names imported through a module that only passes them on (import the real module, or "
                       "list a public alias in unisleep/__init__.py's docstring):\n" + "\n".join(found))
