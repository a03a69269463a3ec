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
