"""unisleep.ray on a real local Ray cluster (``ray.init(num_cpus=2)``): a trainer actor and an engine
actor build their transfer group through the object store and move weights over gloo, byte-exact
after each update; the group secret is never on a process's command line; ``unisleep demo --ray``
passes on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'unisleep[ray]' (CI installs it with .[test])")

from unisleep.ray import Ticket, TransferActor, connect, new_ticket  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["embed.weight", "layer.0.w", "layer.0.b", "head.weight"]
SHAPES = [(64, 32), (32, 32), (32,), (64, 32)]


class _Trainer(TransferActor):
    def __init__(self):
        import torch

        torch.manual_seed(0)
        self.w = {n: torch.randn(s) for n, s in zip(NAMES, SHAPES)}
        self.sender = None

    def update_and_send(self, version: str, seed: int):
        import torch

        g = torch.Generator().manual_seed(seed)
        for t in self.w.values():  # a new version: every tensor changes
            t.add_(torch.randn(t.shape, generator=g))
        if self.sender is None:
            self.sender = self.unisleep_sender(path="collective")
        self.sender.send(list(self.w.items()), version=version)
        return {n: t.clone() for n, t in self.w.items()}

    def pid(self):
        return os.getpid()

    def held_secret(self) -> bytes:  # the test reads it here, to look for it in every command line
        return self._unisleep_ticket.secret


class _Engine(TransferActor):
    def __init__(self):
        import torch

        self.w = {n: torch.zeros(s) for n, s in zip(NAMES, SHAPES)}
        self.receiver = None

    def receive(self):
        if self.receiver is None:
            self.receiver = self.unisleep_receiver(target=self.w)
        rep = self.receiver.receive()
        return rep.version, {n: t.clone() for n, t in self.w.items()}

    def pid(self):
        return os.getpid()


@pytest.fixture(scope="module")
def cluster():
    # the actor classes above live in this test module, which Ray's workers cannot import: send them by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cmdlines() -> dict[int, bytes]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    out[int(d)] = f.read()
            except OSError:
                pass
    return out


def test_trainer_and_engine_actors_move_weights_byte_exact_and_keep_the_secret_off_command_lines(cluster):
    import torch

    Trainer = ray.remote(num_cpus=1)(_Trainer)
    Engine = ray.remote(num_cpus=1)(_Engine)
    trainer, engine = Trainer.remote(), Engine.remote()
    try:
        members = connect(trainer, [engine], timeout_s=120)
        assert [m["rank"] for m in members] == [0, 1] and {m["backend"] for m in members} == {"gloo"}
        rdv = members[0]["rendezvous"]
        assert rdv == members[1]["rendezvous"] and rdv.startswith("tcp://")
        for step in range(1, 4):
            sent, (version, got) = ray.get([trainer.update_and_send.remote(str(step), step),
                                            engine.receive.remote()], timeout=120)
            assert version == str(step)
            for n in NAMES:  # byte for byte, not approximately
                assert torch.equal(sent[n].view(torch.int32), got[n].view(torch.int32)), (step, n)
            assert not torch.equal(sent["embed.weight"], torch.zeros(SHAPES[0]))
        # the secret the actors hold is on no process's command line (actors, raylet, workers, this one)
        secret = ray.get(trainer.held_secret.remote())
        assert len(secret) >= 32
        pids = ray.get([trainer.pid.remote(), engine.pid.remote()])
        lines = _cmdlines()
        assert set(pids) <= set(lines)  # the actors' own processes were read
        for pid, line in lines.items():
            assert secret not in line and secret.hex().encode() not in line, pid
    finally:
        for a in (trainer, engine):
            try:
                ray.get(a.unisleep_close.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(a)


def test_ticket_hides_its_secret_and_uses_an_os_given_port():
    t = new_ticket(2, host="127.0.0.1")
    assert isinstance(t, Ticket) and t.world_size == 2 and len(t.secret) == 32
    assert t.secret.hex() not in repr(t) and "secret" not in repr(t)
    assert t.rendezvous.startswith("tcp://127.0.0.1:") and int(t.rendezvous.rsplit(":", 1)[1]) > 0
    assert new_ticket(2, host="127.0.0.1").secret != t.secret  # fresh per group


def test_connect_refuses_no_engines(cluster):
    from unisleep.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="at least one engine"):
        connect(object(), [])


def test_demo_ray_passes_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("UNISLEEP_PLATFORM", "RAY_ADDRESS")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-m", "unisleep", "demo", "--ray", "--steps", "5", "--batch", "32", "--lr",
                        "0.01", "--no-plot", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((out / "demo.json").read_text())
    assert res["ok"] and res["ray"] and res["byte_exact"] == [True] * 5
    assert res["engine_pid"] != res["trainer_pid"] and res["members"][0]["backend"] == "gloo"
    assert "[PASS] weights byte-exact" in r.stdout and "[PASS] policy learned" in r.stdout
