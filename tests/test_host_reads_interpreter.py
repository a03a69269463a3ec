"""The SM copy kernel of the CUDA backend's restores (backends/cuda/host_reads.py), its logic on
the CPU through Triton's interpreter: every byte lands, whatever the length and alignment.  On
the GPU it is tested by tests/cuda/test_host_reads_cuda.py."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sm_copy_kernel_copies_every_byte_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="needs the triton package (pip install triton)")
    code = textwrap.dedent(
        """
        import torch
        from unisleep.backends.cuda import host_reads as hr
        assert hr.available(), hr._error
        src = torch.randint(0, 256, (5 * hr.WORDS * 8 + 21,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
        for lo, n in ((0, 0), (0, 1), (0, 8), (0, 13), (8, hr.WORDS * 8), (16, 3 * hr.WORDS * 8 + 5), (3, 100), (0, src.numel())):
            dst = torch.full((n + 16,), 7, dtype=torch.uint8)
            hr.copy(dst[8: 8 + n], src[lo: lo + n])
            assert torch.equal(dst[8: 8 + n], src[lo: lo + n]), (lo, n)
            assert bool((dst[:8] == 7).all()) and bool((dst[8 + n:] == 7).all()), (lo, n)  # nothing beyond
        print("OK")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]
