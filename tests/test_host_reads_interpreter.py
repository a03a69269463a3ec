"""The SM copy kernel of the CUDA backend's restores (backends/cuda/host_reads.py), its logic on
the CPU through Triton's interpreter: every byte lands, whatever the length and alignment.  On
the GPU it is tested by tests/cuda/test_host_reads_cuda.py."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: run before each test's code: the kernel module as ``hr``, its launches counted in ``launches``
#: (so a case proves it used the kernel, or not)
PRELUDE = textwrap.dedent(
    """
    import torch
    from unisleep.backends.cuda import host_reads as hr
    assert hr.available(), hr._copy.error
    kernel, launches = hr._copy.kernel, []
    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]
    hr._copy.kernel = Counted()
    """
)


def _run_interpreted(code: str, env: dict) -> None:
    """Run ``PRELUDE`` + ``code`` in a fresh Python under Triton's interpreter; it prints OK."""
    p = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]


def test_sm_copy_kernel_copies_every_byte_in_the_triton_interpreter(triton_interpreter_env):
    code = textwrap.dedent(
        """
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
    _run_interpreted(code, triton_interpreter_env)


def test_sm_copy_kernel_zeroes_what_the_feed_gives_it_and_no_more_in_the_triton_interpreter(triton_interpreter_env):
    """The reads of a wake also zero the regions that come back empty (the KV cache): each read
    block zeroes up to ZeroFeed.per_block blocks, range after range (a launch per range); what
    they cannot carry (too much, a tail under a block, a misaligned or small range) is left in
    rest() for the caller's memset."""
    code = textwrap.dedent(
        """
        B = hr.BLOCK_BYTES
        src = torch.randint(0, 256, (6 * B + 7,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        mem = torch.full((40 * B,), 7, dtype=torch.uint8)
        # three ranges to zero: 5 whole blocks, 2 blocks and a tail, and one that is not 16-byte aligned
        spans = [(B, 5 * B), (8 * B, 2 * B + 100), (12 * B + 3, B)]
        feed = hr.ZeroFeed([mem[a: a + n] for a, n in spans], read_bytes=3 * B, min_bytes=0)
        assert feed.per_block == 3  # 7 whole blocks over 3 blocks of reads: ceil(7 / 3)
        dst = torch.zeros(6 * B + 7, dtype=torch.uint8)
        hr.copy(dst[: B], src[: B], feed)  # 1 read block: 3 blocks of the first range
        assert feed.zeroed == 3 * B and not bool(mem[B: 4 * B].any()) and bool((mem[4 * B:] == 7).all())
        del launches[:]
        # 2 read blocks: one carries the first range's last 2 blocks, the other the second range's 2
        hr.copy(dst[B: 3 * B + 7], src[B: 3 * B + 7], feed)
        assert launches == [(1,), (1,)], launches
        assert torch.equal(dst[: 3 * B + 7], src[: 3 * B + 7])
        assert feed.zeroed == 7 * B
        assert not bool(mem[B: 6 * B].any()) and not bool(mem[8 * B: 10 * B].any())
        assert bool((mem[:B] == 7).all()) and bool((mem[6 * B: 8 * B] == 7).all()) and bool((mem[10 * B:] == 7).all())
        hr.copy(dst[3 * B + 7:], src[3 * B + 7:], feed)  # not aligned: copy_, no zeroing
        assert feed.zeroed == 7 * B and torch.equal(dst, src)
        del launches[:]
        hr.copy(dst[:2 * B], src[:2 * B], feed)  # nothing left to carry: one plain launch
        assert launches == [(2,)] and feed.zeroed == 7 * B
        rest = feed.rest()
        assert sorted((t.data_ptr() - mem.data_ptr(), t.numel()) for t in rest) == [(10 * B, 100), (12 * B + 3, B)]
        assert feed.rest() == [] and feed.take(10) == (None, 0)
        assert bool((mem[10 * B:] == 7).all())  # nothing zeroed beyond what was given
        # more to zero than 4 blocks per block read: the feed caps it, the rest is left
        big = torch.full((20 * B,), 7, dtype=torch.uint8)
        f2 = hr.ZeroFeed([big], read_bytes=2 * B, min_bytes=0)
        assert f2.per_block == hr.MAX_ZERO_PER_BLOCK == 4
        hr.copy(torch.empty(2 * B, dtype=torch.uint8), src[: 2 * B], f2)
        assert f2.zeroed == 8 * B and not bool(big[: 8 * B].any()) and bool((big[8 * B:] == 7).all())
        assert [t.numel() for t in f2.rest()] == [12 * B]
        # by default a range under MIN_ZERO_BYTES is left whole to the caller
        f3 = hr.ZeroFeed([big], read_bytes=2 * B)
        assert hr.MIN_ZERO_BYTES > big.numel() and f3.per_block == 0 and f3.take(2) == (None, 0)
        assert [t.numel() for t in f3.rest()] == [20 * B]
        print("OK")
        """
    )
    _run_interpreted(code, triton_interpreter_env)
