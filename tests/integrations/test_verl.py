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
    # actor rank 0's ticket: this node's address (loopback without Ray), a port, a fresh secret
    # kept out of its repr; build_topology hands every worker the same one, sized to the group
    master = CheckpointEngineRegistry.new("unisleep", bucket_size=BUCKET, is_master=True)
    meta = master.prepare()
    t = meta["ticket"]
    assert t.rendezvous.startswith("tcp://127.0.0.1:") and len(t.secret) == 32
    assert t.secret.hex() not in repr(t) and master.prepare() == meta   # kept across syncs
    actor, rollout = cls.build_topology(2, 2, [meta, {}, {}, {}])
    assert {x.world_size for x in actor["ticket"] + rollout["ticket"]} == {3}
    assert {x.secret for x in actor["ticket"] + rollout["ticket"]} == {t.secret}
    assert actor["rank"] == [0, -1] and rollout["rank"] == [1, 2]


def test_an_actor_rank_outside_the_group_walks_the_generator():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    eng = CheckpointEngineRegistry.new("unisleep", bucket_size=BUCKET, is_master=False)
    eng.init_process_group(rank=-1, world_size=3, ticket=None)
    walked = []

    def gen():
        for n, t in W.make_state(3).items():
            walked.append(n)
            yield n, t

    assert asyncio.run(eng.send_weights(gen(), global_steps=3)) == {}
    assert walked == list(W.make_state(3))


class _Workers:
    def __init__(self, ctx, roles, engine_kwargs, bucket=BUCKET, first=None):
        self.procs, self.conns = [], []
        for role, master in roles:
            a, b = ctx.Pipe()
            p = ctx.Process(target=W.main, args=(role, master, bucket, engine_kwargs, b, first), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(a)

    def ask(self, i, cmd, arg=None):
        self.conns[i].send((cmd, arg))

    def answer(self, i, timeout=240):
        if not self.conns[i].poll(timeout):
            raise TimeoutError(f"worker {i} did not answer within {timeout} s")
        return self.conns[i].recv()

    def connect(self):
        """prepare -> build_topology -> init_process_group, as CheckpointEngineManager does."""
        from unisleep.integrations.verl import UnisleepCheckpointEngine

        n = len(self.conns)
        meta = [ans for st, ans in self.all("prepare", [None] * n)]
        actor_kw, rollout_kw = UnisleepCheckpointEngine.build_topology(1, n - 1, meta)
        per_worker = [{k: v[0] for k, v in actor_kw.items()}] + \
            [{k: v[i] for k, v in rollout_kw.items()} for i in range(n - 1)]
        answers = self.all("init", per_worker)
        assert all(st == "ok" for st, _ in answers), answers

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


@pytest.mark.parametrize("path", ["collective", "auto"])
def test_a_sync_streams_bucket_by_bucket(path, monkeypatch):
    """A model 48 buckets long, produced tensor by tensor: the rollout's consumer sees the first
    tensors before the actor's generator has produced the last one, and neither side's peak
    resident memory grows by more than about two buckets (the model is 48)."""
    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    # glibc then maps every allocation of 1 MiB or more on its own and unmaps it when freed, so
    # the resident set shows what the adapter holds, not what the C allocator keeps cached
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    ctx = mp.get_context("spawn")
    first = ctx.Event()
    bucket, n, numel = 4 << 20, 48, 1 << 20   # 48 float32 tensors of 4 MiB: one bucket each
    w = _Workers(ctx, [("actor", True), ("rollout", False)], {"path": path}, bucket=bucket, first=first)
    try:
        w.connect()
        for seed in (1, 2, 3):  # from the second sync: buffers already made, the group kept
            first.clear()
            w.ask(1, "recv_lazy", seed)
            w.ask(0, "send_lazy", (n, numel, seed, 60))
            sent, got = w.answer(0), w.answer(1)
            assert sent[0] == "ok" and got[0] == "ok", (sent, got)
            assert sent[1]["saw_first"] == [True]    # streamed: not held back until the last tensor
            assert got[1]["names"] == [f"layers.{i}.weight" for i in range(n)]
            assert got[1]["digest"] == W.lazy_digest(n, numel, seed)
            # from the second sync on (the first one makes the group's channels and buffers); the
            # IPC path maps the sender's two buffers on top (shared pages, counted on both sides)
            if path == "collective" and seed > 1:
                for side in (sent[1], got[1]):
                    assert side["peak_extra"] < 2 * bucket + (12 << 20), (side, n * bucket)
            assert all(st == "ok" for st, _ in w.all("finalize", [None] * 2))
    finally:
        w.close()


def test_whole_update_staging_is_an_opt_in(monkeypatch):
    """``staging="host"``: nothing is yielded until every chunk has verified (the old behaviour,
    kept as an opt-in) — the consumer's first tensor comes only after the generator ended."""
    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    ctx = mp.get_context("spawn")
    first = ctx.Event()
    w = _Workers(ctx, [("actor", True), ("rollout", False)], {"path": "collective", "staging": "host",
                                                              "timeout_s": 120.0},
                 bucket=1 << 20, first=first)
    try:
        w.connect()
        w.ask(1, "recv_lazy", 1)
        w.ask(0, "send_lazy", (6, 1 << 18, 1, 5))
        sent, got = w.answer(0, 300), w.answer(1, 300)
        assert sent[0] == "ok" and got[0] == "ok", (sent, got)
        assert sent[1]["saw_first"] == [False]
        assert got[1]["digest"] == W.lazy_digest(6, 1 << 18, 1)
    finally:
        w.close()


def test_a_failure_part_way_reaches_verls_consumer_with_its_outcome(monkeypatch):
    """The trainer's generator fails after some chunks were yielded: the actor raises that error,
    the rollout's consumer gets TornWeightsError with ``outcome == "torn"`` at once (not after
    the timeout); a failure before the first chunk gives ``outcome == "untouched"``; the next
    sync goes through."""
    monkeypatch.setenv("UNISLEEP_PLATFORM", "host")
    ctx = mp.get_context("spawn")
    w = _Workers(ctx, [("actor", True), ("rollout", False)], {"path": "collective", "timeout_s": 120.0},
                 bucket=1 << 20)
    try:
        w.connect()
        for fail_at, outcome, err in ((5, "torn", "TornWeightsError"), (0, "untouched", "TransferError")):
            w.ask(1, "recv_lazy", 1)
            w.ask(0, "send_lazy", (8, 1 << 18, 1, 0, fail_at))
            sent, got = w.answer(0, 100), w.answer(1, 100)
            assert sent[0] == "error" and "generator failed at tensor" in sent[1], sent
            assert got[0] == "ok" and got[1]["error"] == err and got[1]["outcome"] == outcome, got
            assert "generator failed at tensor" in got[1]["msg"]
        w.ask(1, "recv_lazy", 2)
        w.ask(0, "send_lazy", (8, 1 << 18, 2, 0))
        sent, got = w.answer(0, 100), w.answer(1, 100)
        assert sent[0] == "ok" and got[0] == "ok" and got[1]["digest"] == W.lazy_digest(8, 1 << 18, 2), (sent, got)
    finally:
        w.close()
