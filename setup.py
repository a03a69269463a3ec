"""Builds the one native file of unisleep: the torch_memory_saver compatibility library
(unisleep/compat/csrc/tms_preload.c, plain C needing only libc), installed as
``unisleep/torch_memory_saver_hook_mode_preload.abi3.so`` — the name and place slime and AReaL look
for next to ``torch_memory_saver.__file__``.  Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
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
