"""What a colocated update costs when the engine copies straight from the trainer's own tensors
(one hand-over, no bucket memory on either side), beside the parts it is made of: two processes
on one GPU, the trainer's 8 GiB in 32 tensors of 256 MiB (torch's caching allocator), shared
with torch's CUDA IPC (``cudaIpcGetMemHandle`` of each allocation), opened by the engine.

    PYTHONPATH=. python3 tools/cuda_probes/ipc_direct.py --gib 8 --out result.json

Timed (median of ``--repeat``), each on the GPU with a synchronisation at its end: the trainer's
keyed digest of its tensors (``keyed_hash.digest_many``); in the engine, opening the handles the
first time and again (torch caches opened handles); the copy of every tensor into the engine's
own; the keyed digest of the trainer's tensors read through IPC, then the copy (verify, then
apply); and the copy alone within one process, for the bandwidth.  A developer probe: it moves
the handles with torch.multiprocessing between two processes of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _sync():
    import torch

    torch.cuda.synchronize()


def _timed(fn, repeat):
    out = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out), out


def _engine(q_in, q_out, n, numel, repeat, key_bytes):
    import torch

    import unisleep.registry  # noqa: F401 - installs the CUDA backend's digest kernels
    from unisleep.keyed_hash import HashKey, digest_many

    torch.cuda.set_device(0)
    dst = [torch.empty(numel, dtype=torch.uint8, device="cuda") for _ in range(n)]
    key = HashKey.derive(key_bytes, b"probe", numel)
    res = {}
    t0 = time.perf_counter()
    src = q_in.get()          # the first time: the handles are opened here
    _sync()
    res["open_first_s"] = time.perf_counter() - t0
    q_out.put("opened")
    t0 = time.perf_counter()
    src2 = q_in.get()         # the same allocations again (torch's cache of opened handles)
    _sync()
    res["open_again_s"] = time.perf_counter() - t0
    del src2

    def copy():
        for d, s in zip(dst, src):
            d.copy_(s)

    def verify_then_copy():
        digest_many(src, [key] * n)
        copy()

    res["copy_s"], res["copy_all"] = _timed(copy, repeat)
    res["verify_then_copy_s"], res["verify_then_copy_all"] = _timed(verify_then_copy, repeat)
    res["ok"] = all(torch.equal(d, s) for d, s in zip(dst, src))
    q_out.put(res)
    q_in.get()  # the trainer may free its tensors now


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--tensor-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import secrets

    import torch
    import torch.multiprocessing as mp

    import unisleep.registry  # noqa: F401 - installs the CUDA backend's digest kernels
    from unisleep.keyed_hash import HashKey, digest_many

    torch.cuda.set_device(0)
    numel = a.tensor_mib << 20
    n = (a.gib << 30) // numel
    src = [torch.randint(0, 255, (numel,), dtype=torch.uint8, device="cuda") for _ in range(n)]
    key_bytes = secrets.token_bytes(32)
    key = HashKey.derive(key_bytes, b"probe", numel)
    res = {"gib": a.gib, "tensors": n, "tensor_mib": a.tensor_mib, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0)}
    res["trainer_digest_s"], res["trainer_digest_all"] = _timed(lambda: digest_many(src, [key] * n), a.repeat)
    dst = [torch.empty_like(t) for t in src]
    res["copy_in_process_s"], _ = _timed(lambda: [d.copy_(s) for d, s in zip(dst, src)], a.repeat)
    del dst
    torch.cuda.empty_cache()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_engine, args=(q_in, q_out, n, numel, a.repeat, key_bytes))
    p.start()
    q_in.put(src)
    q_out.get(timeout=300)
    q_in.put(src)
    res.update(q_out.get(timeout=600))
    q_in.put("done")
    p.join(60)
    gb = (a.gib << 30) / 1e9
    res["copy_GBps"] = gb / res["copy_s"]
    res["one_hand_over_estimate_s"] = res["trainer_digest_s"] + res["verify_then_copy_s"]
    print(f"{a.gib} GiB in {n} x {a.tensor_mib} MiB: trainer digest {res['trainer_digest_s'] * 1e3:.2f} ms; "
          f"engine: open {res['open_first_s'] * 1e3:.1f} ms first, {res['open_again_s'] * 1e3:.2f} ms again; "
          f"copy through IPC {res['copy_s'] * 1e3:.2f} ms ({res['copy_GBps']:.0f} GB/s; in one process "
          f"{res['copy_in_process_s'] * 1e3:.2f} ms); verify then copy {res['verify_then_copy_s'] * 1e3:.2f} ms; "
          f"trainer digest + verify then copy {res['one_hand_over_estimate_s'] * 1e3:.2f} ms; bytes equal: {res['ok']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
