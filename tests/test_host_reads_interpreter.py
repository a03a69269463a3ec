"""The SM copy kernel of the CUDA backend's restores (backends/cuda/host_reads.py), its logic on
the CPU through Triton's interpreter: every byte lands, whatever the length and alignment.  On
the GPU it is tested by tests/cuda/test_host_reads_cuda.py."""

import os
import subprocess
import sys
import textwrap


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sm_copy_kernel_copies_every_byte_in_the_triton_interpreter(triton_interpreter_env):
    code = textwrap.dedent(
        """
        import torch
        from unisleep.backends.cuda import host_reads as hr
        assert hr.available(), hr._error
        kernel, launches = hr._kernel, []
        class Counted:  # counts the kernel's launches, so the aligned cases prove they used it
            def __getitem__(self, grid):
                launches.append(grid)
                return kernel[grid]
        hr._kernel = Counted()
        B = hr.WORDS * 8  # bytes per block
        src = torch.randint(0, 256, (7 * B + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
        cases = ((0, 0, False), (0, 13, False), (0, B, True), (16, 3 * B + 5, True), (0, 5 * B, True),
                 (32, 7 * B + 21, True), (3, B + 100, False), (8, 2 * B, False))
        for lo, n, by_kernel in cases:
            dst = torch.full((n + 32,), 7, dtype=torch.uint8)
            before = len(launches)
            hr.copy(dst[16: 16 + n], src[lo: lo + n])
            assert torch.equal(dst[16: 16 + n], src[lo: lo + n]), (lo, n)
            assert bool((dst[:16] == 7).all()) and bool((dst[16 + n:] == 7).all()), (lo, n)  # nothing beyond
            assert (len(launches) > before) == by_kernel, (lo, n, launches[before:])
        print("OK")
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=triton_interpreter_env,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]
