"""Builds the one native file of unisleep: the torch_memory_saver compatibility library
(unisleep/compat/csrc/tms_preload.c, plain C needing only libc), installed as
``unisleep/torch_memory_saver_hook_mode_preload.abi3.so`` — the name and place slime and AReaL look
for next to ``torch_memory_saver.__file__``.  Everything else is in pyproject.toml.

The library serves only torch_memory_saver's preload mode, so it is optional: without a C compiler
(``$CC``, else the one Python was built with, not on ``PATH``) unisleep installs without it, says so,
and the preload features raise ``NativeLibraryMissingError`` naming how to get it.  A compiler that
is there but fails is a real error and stops the install.  ``UNISLEEP_REQUIRE_NATIVE=1`` makes a
missing compiler stop it too (for builds that must ship the library)."""

import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildNativeIfCompiler(build_ext):
    """build_ext that leaves the extension out, saying why, when its compiler is not installed
    (decided before building, so wheels, editable installs and in-place builds all agree)."""

    def run(self):
        exe = compiler_executable()
        if self.extensions and exe is not None and shutil.which(exe) is None:
            names = ", ".join(self.get_ext_filename(e.name) for e in self.extensions)
            msg = (f"unisleep: no C compiler ({exe!r} is not on PATH): installing without {names} (torch_memory_saver's "
                   "preload mode only; everything else works). To get it: install a C compiler (e.g. apt-get install "
                   "gcc), then install unisleep again.")
            if os.environ.get("UNISLEEP_REQUIRE_NATIVE") == "1":
                raise SystemExit(msg.replace("installing without", "UNISLEEP_REQUIRE_NATIVE=1 and cannot build"))
            print(msg, file=sys.stderr)
            self.extensions = []
        super().run()


def compiler_executable():
    """The C compiler build_ext would run: ``$CC``'s first word, else the one Python was built
    with (sysconfig's CC); None when neither names one."""
    import shlex
    import sysconfig

    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or ""
    words = shlex.split(cc)
    return words[0] if words else None


setup(
    cmdclass={"build_ext": BuildNativeIfCompiler},
    ext_modules=[
        Extension(
            "unisleep.torch_memory_saver_hook_mode_preload",
            sources=["unisleep/compat/csrc/tms_preload.c"],
            py_limited_api=True,  # named .abi3.so, as torch_memory_saver's own library
            extra_compile_args=["-O2", "-fvisibility=hidden", "-std=gnu11"],
            libraries=["dl", "pthread"],
        )
    ],
)
