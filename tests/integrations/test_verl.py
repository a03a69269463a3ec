"""unisleep's verl checkpoint engine driven through verl's own code (verl 0.9.1, installed
--no-deps in .venv-vllm024 by ``make test``; tests/vllm/test_vllm_other_versions.py runs this file
there): verl's ``import_external_libs`` loads ``unisleep.integrations.verl`` as
``checkpoint_engine.custom_backend_module`` does, ``CheckpointEngineRegistry`` hands out the
engine, and the engine's ``prepare`` / ``build_topology`` / ``init_process_group`` /
``send_weights`` / ``receive_weights`` / ``finalize`` run in the order verl's
``CheckpointEngineManager`` calls them — one actor process and two rollout processes, real gloo
and IPC transfer on CPU."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys

import pytest

verl = pytest.importorskip(
    "verl", reason="verl is not installed here: make test installs verl 0.9.1 in .venv-vllm024 and "
                   "runs this file there (tests/vllm/test_vllm_other_versions.py)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _verl_worker as W  # noqa: E402

pytestmark = pytest.mark.slow
BUCKET = 1 << 20  # 1 MiB buckets: the 2 MiB lm_head gets a bucket of its own


def test_registered_through_verls_plugin_point():
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(W.BACKEND_MODULE)
    cls = CheckpointEngineRegistry.get("unisleep")
    from unisleep.integrations.verl import UnisleepCheckpointEngine

    assert cls is UnisleepCheckpointEngine and issubclass(cls, CheckpointEngine)
    assert not cls.__abstractmethods__
    eng = CheckpointEngineRegistry.new("unisleep", bucket_size=BUCKET, is_master=False)
    assert eng.prepare() == {}
    with pytest.raises(Exception, match="master"):
        cls.build_topology(2, 2, [{}, {}, {}, {}])


def test_an_actor_rank_outside_the_group_walks_the_generator():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    eng = CheckpointEngineRegistry.new("unisleep", bucket_size=BUCKET, is_master=False)
    eng.init_process_group(rank=-1, world_size=3, rendezvous="tcp://127.0.0.1:1")
    walked = []

    def gen():
        for n, t in W.make_state(3).items():
            walked.append(n)
            yield n, t

    assert asyncio.run(eng.send_weights(gen(), global_steps=3)) == {}
    assert walked == list(W.make_state(3))


class _Workers:
    def __init__(self, ctx, roles, engine_kwargs):
        self.procs, self.conns = [], []
        for role, master in roles:
            a, b = ctx.Pipe()
            p = ctx.Process(target=W.main, args=(role, master, BUCKET, engine_kwargs, b), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(a)

    def ask(self, i, cmd, arg=None):
        self.conns[i].send((cmd, arg))

    def answer(self, i, timeout=240):
        if not self.conns[i].poll(timeout):
            raise TimeoutError(f"worker {i} did not answer within {timeout} s")
        return self.conns[i].recv()

    def all(self, cmd, args):
        for i, a in enumerate(args):
            self.ask(i, cmd, a)
        return [self.answer(i) for i in range(len(args))]

    def close(self):
        for i in range(len(self.conns)):
            try:
                self.ask(i, "stop")
                self.answer(i, 30)
            except Exception:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("path", ["collective", "auto"])
def test_weight_sync_rounds_in_verls_order(path, monkeypatch):
    """Three syncs: good, tampered (refused: the rollouts yield nothing), good again — with the
    group built once.  ``auto`` takes IPC here (same machine), ``collective`` gloo."""
    from unisleep.integrations.verl import UnisleepCheckpointEngine

    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    ctx = mp.get_context("spawn")
    w = _Workers(ctx, [("actor", True), ("rollout", False), ("rollout", False)], {"path": path})
    try:
        group_ids = None
        for rnd, (seed, corrupt) in enumerate([(1, False), (2, True), (3, False)]):
            meta = [ans for st, ans in w.all("prepare", [None] * 3)]
            actor_kw, rollout_kw = UnisleepCheckpointEngine.build_topology(1, 2, meta)
            per_worker = [{k: v[0] for k, v in actor_kw.items()}] + \
                [{k: v[i] for k, v in rollout_kw.items()} for i in range(2)]
            answers = w.all("init", per_worker)
            assert all(st == "ok" for st, _ in answers), answers
            ids = [gid for _, gid in answers]
            assert group_ids in (None, ids)  # the group is kept across syncs
            group_ids = ids
            w.ask(1, "recv", seed)
            w.ask(2, "recv", seed)
            w.ask(0, "send", (seed, corrupt))
            sent, got1, got2 = w.answer(0), w.answer(1), w.answer(2)
            if corrupt:
                assert sent[0] == "error" and "TransferError" in sent[1], sent
                for got in (got1, got2):   # nothing yielded to the rollout: it raised instead
                    assert got[0] == "error" and "TransferError" in got[1], got
            else:
                assert sent[0] == "ok" and sent[1]["unisleep/transfer_gbps"] > 0, sent
                want = W.digest(W.make_state(seed).items())
                for got in (got1, got2):
                    assert got[0] == "ok", got
                    assert got[1]["digest"] == want and got[1]["names"] == list(W.make_state(seed))
                    assert got[1]["version"].endswith(f":{seed}")
                    assert got[1]["path"] == ("ipc" if path == "auto" else "collective")
            assert all(st == "ok" for st, _ in w.all("finalize", [None] * 3))
    finally:
        w.close()
