"""Not a simulator: the probes that compare a ctypes binding with a vendor's REAL C header.

Given the binding's structs (C name -> ctypes declaration), its enums/codes (C name -> value)
and its prototype table (name -> (restype, argtypes)), these generate a C probe (built with
``cc``) that prints ``sizeof``/``_Alignof`` of every struct, ``offsetof``/``sizeof`` of every
(nested) field and the value of every enum and code, and a C++ probe (``c++``) that prints each
function's parameters as the ABI sees them (integer of n bytes, pointer to n bytes, opaque
pointer).  Only *names* come from the binding: every number comes from the compiler reading
the header, and a name the header lacks fails the compile.  Used by tests/test_hip_real.py
(HIP) and tests/test_ascend_sim.py (ACL, where the CANN headers exist).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import textwrap
from typing import Optional


def struct_layout(cname: str, cls, base: int = 0, path: str = "") -> dict:
    """sizeof/alignof/offsetof/size of a ctypes struct and every (nested) field, keyed like the probe."""
    out = {} if path else {f"sizeof {cname}": ctypes.sizeof(cls), f"alignof {cname}": ctypes.alignment(cls)}
    for name, ctype in cls._fields_:
        field = path + name
        off = base + getattr(cls, name).offset
        out[f"offsetof {cname}.{field}"] = off
        out[f"sizeof {cname}.{field}"] = ctypes.sizeof(ctype)
        if isinstance(ctype, type) and issubclass(ctype, ctypes.Structure):
            out.update(struct_layout(cname, ctype, off, field + "."))
    return out


def binding_layout(structs: dict, enums: dict) -> dict:
    out = {}
    for cname, cls in structs.items():
        out.update(struct_layout(cname, cls))
    out.update({f"value {name}": value for name, value in enums.items()})
    return out


def ctype_abi(t):
    if t in (ctypes.c_void_p, ctypes.c_char_p):
        return ["ptr", None]
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return ["ptr", ctypes.sizeof(t._type_)]
    return ["int", ctypes.sizeof(t)]


def binding_prototypes(prototypes: dict) -> dict:
    return {name: [ctype_abi(res), [ctype_abi(a) for a in args]] for name, (res, args) in prototypes.items()}


def compile_run(tmp_path, name: str, source: str, compiler: list, flags: list) -> dict:
    src = tmp_path / name
    src.write_text(source)
    exe = tmp_path / (name + ".bin")
    cp = subprocess.run(compiler + flags + [str(src), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, f"the probe does not compile against the header ({' '.join(flags)}):\n{cp.stderr[-4000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _printf_lines(keys) -> str:
    out = []
    for key in keys:
        what, name = key.split(" ", 1)
        cname, _, field = name.partition(".")
        if what == "value":
            expr = f"(long long)({name})"
        elif what == "alignof":
            expr = f"(long long)_Alignof({cname})"
        elif what == "sizeof":
            expr = f"(long long)sizeof({cname})" if not field else f"(long long)sizeof((({cname}*)0)->{field})"
        else:
            expr = f"(long long)offsetof({cname}, {field})"
        out.append(f'    printf(",\\n  \\"{key}\\": %lld", {expr});')
    return "\n".join(out)


def c_layout_probe(tmp_path, include: str, flags: list, keys, version_macro: Optional[str] = None,
                   legacy: Optional[tuple] = None) -> dict:
    """Run the C probe for ``keys``; with ``legacy=(threshold, legacy_keys)``, the header's
    ``version_macro`` picks which key set is asked for (``>= threshold``: ``keys``)."""
    head = f'    printf("{{\\n  \\"VERSION\\": %lld", (long long)({version_macro}));' if version_macro else \
        '    printf("{\\n  \\"VERSION\\": 0");'
    if legacy:
        body = f"#if {version_macro} >= {legacy[0]}\n{_printf_lines(keys)}\n#else\n{_printf_lines(legacy[1])}\n#endif"
    else:
        body = _printf_lines(keys)
    src = textwrap.dedent("""\
        #include <stdio.h>
        #include <stddef.h>
        #include <%s>
        int main(void) {
        """) % include + head + "\n" + body + '\n    printf("\\n}\\n");\n    return 0;\n}\n'
    return compile_run(tmp_path, "abi_probe.c", src, ["cc", "-std=c11", "-Wall", "-Werror"], flags)


CXX_PROBE = r"""
#include <cstdio>
#include <string>
#include <type_traits>
#include <%(include)s>
template<class T, class = void> struct is_complete : std::false_type {};
template<class T> struct is_complete<T, decltype(void(sizeof(T)))> : std::true_type {};
template<class T> std::string abi() {
  if constexpr (std::is_pointer<T>::value) {
    using P = std::remove_cv_t<std::remove_pointer_t<T>>;
    if constexpr (std::is_void<P>::value) return "[\"ptr\", null]";
    else if constexpr (!is_complete<P>::value) return "[\"ptr\", null]";
    else return "[\"ptr\", " + std::to_string(sizeof(P)) + "]";
  } else if constexpr (std::is_integral<T>::value || std::is_enum<T>::value) {
    return "[\"int\", " + std::to_string(sizeof(T)) + "]";
  } else return "[\"other\", " + std::to_string(sizeof(T)) + "]";
}
template<class R, class... A> std::string sig(R (*)(A...)) {
  std::string s = "[" + abi<R>() + ", [";
  [[maybe_unused]] const char* sep = "";
  ((s += sep, s += abi<A>(), sep = ", "), ...);
  return s + "]]";
}
int main() {
  std::printf("{\n");
%(calls)s
  std::printf("}\n");
  return 0;
}
"""


def cxx_prototype_probe(tmp_path, include: str, flags: list, names) -> dict:
    names = list(names)
    calls = "\n".join(
        f'  std::printf("  \\"{n}\\": %s{"," if i < len(names) - 1 else ""}\\n", '
        f"sig(static_cast<decltype(&{n})>(nullptr)).c_str());"
        for i, n in enumerate(names)
    )
    src = CXX_PROBE.replace("%(include)s", include).replace("%(calls)s", calls)
    return compile_run(tmp_path, "proto_probe.cc", src, ["c++", "-std=c++17", "-Wall", "-Werror"], flags)


def diff(ours: dict, theirs: dict) -> list[str]:
    return [f"{k}: bindings {ours.get(k)!r}, header {theirs.get(k)!r}"
            for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]


def binding_signatures(signatures: dict) -> dict:
    """name -> [return ABI, [[parameter name, "int"/"ptr", width], ...]] of a named signature
    table (``hip.signatures()``, ``acl.SIGNATURES``): the ABI of each parameter and its name,
    so two parameters of the same class swapped (``size``/``offset``, ``dst``/``src``) differ."""
    return {name: [ctype_abi(res), [[p] + ctype_abi(t) for p, t in params]]
            for name, (res, params) in signatures.items()}


def with_names(prototypes: dict, names: dict) -> dict:
    """A probe's ``name -> [return, [[kind, width], ...]]`` with each parameter's name (from the
    header's text) put in front, as :func:`binding_signatures` gives them."""
    return {n: [r, [[names.get(n, [None] * len(ps))[i] if i < len(names.get(n, [])) else None] + list(p)
                    for i, p in enumerate(ps)]] for n, (r, ps) in prototypes.items()}


def header_parameter_names(text: str, functions) -> dict:
    """The parameter names of each function's first declaration in a C header's text (comments,
    default arguments and HIP's ``__dparm(...)`` removed); a function the text does not declare
    (only calls or mentions) is left out."""
    import re

    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    out = {}
    for name in functions:
        for m in re.finditer(r"\b" + name + r"\s*\(", text):
            before = text[max(0, m.start() - 80):m.start()].rstrip()
            if not re.search(r"(\w|\*)$", before) or re.search(r"(return|=|\(|,)$", before):
                continue  # a call or a mention, not a declaration (which follows a return type)
            depth, i = 1, m.end()
            while i < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            params = re.sub(r"__dparm\s*\([^)]*\)", "", text[m.end():i - 1])
            params = re.sub(r"=[^,]*", "", params)
            names = []
            for p in [p.strip() for p in params.split(",") if p.strip() and p.strip() != "void"]:
                ident = re.findall(r"[A-Za-z_]\w*", p)
                names.append(ident[-1] if ident else None)
            out[name] = names
            break
    return out


def header_from_table(table: dict) -> str:
    """A C header that declares exactly what a checked-in table (``acl_rt_table.json``) took
    from a vendor header: its typedefs, enums with their values, structs with their fields'
    C types, macros and function prototypes with parameter names.  The probes then compile
    against it like against the vendor's header: the compiler, not the table, lays out structs."""
    lines = ["#ifndef UNISLEEP_TABLE_H", "#define UNISLEEP_TABLE_H", "#include <stddef.h>", "#include <stdint.h>"]
    for name, ctype in table["typedefs"].items():
        lines.append(f"typedef {ctype} {name};")
    for name, members in table["enums"].items():
        body = ", ".join(f"{m} = {v}" for m, v in members)
        lines.append(f"typedef enum {name} {{ {body} }} {name};")
    for name, fields in table["structs"].items():
        body = " ".join(f"{t} {f};" for f, t in fields)
        lines.append(f"typedef struct {name} {{ {body} }} {name};")
    for name, value in table["macros"].items():
        lines.append(f"#define {name} {value}")
    for name, (ret, params) in table["functions"].items():
        args = ", ".join(f"{t} {p}" for p, t in params) or "void"
        lines.append(f"{ret} {name}({args});")
    lines.append("#endif")
    return "\n".join(lines) + "\n"
