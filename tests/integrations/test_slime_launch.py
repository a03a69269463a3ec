"""slime's launch route: unisleep's two variables in slime's ``RUNTIME_ENV_JSON`` reach its driver,
its train actors and its SGLang actors, on a real local Ray cluster (CPU).

slime's scripts (``scripts/run-*.sh``) start ``train.py`` with
``ray job submit --runtime-env-json="${RUNTIME_ENV_JSON}"``.  What Ray does with that JSON, and
what this test does in its place:

* **the driver** — Ray's job supervisor starts the entrypoint with the runtime env's ``env_vars``
  set (``${NAME}`` expanded by ``ray._private.utils.update_envs``) and hands the runtime env to the
  driver's ``ray.init()`` as the job's.  Ray's job server is a dashboard module, which needs
  ``ray[default]`` (not installed here): the test's launcher calls Ray's own ``update_envs`` with
  the JSON's ``env_vars`` and starts the driver, which passes the JSON to ``ray.init(runtime_env=)``.
* **the actors** — Ray merges an actor's own ``env_vars`` over the job's, key by key (Ray's code,
  run here for real).  slime gives its train actors (``RayTrainGroup._allocate_gpus_for_actor``)
  and its SGLang actors (``ServerGroup.start_engines``) variables of their own.

What stands in for slime: without slime's source (slime is not on the package index; CI has
none) the SGLang actor is a Ray actor started, as slime starts ``SGLangEngine``, with
``runtime_env={"env_vars": {...}}`` of its own and with SGLang's released
``TorchMemorySaverAdapter`` (sglang 0.5.10.post1, loaded from the installed package by its file:
the ``sglang`` package needs SGLang's CUDA dependency set) in it and in a *spawn* child, as slime's
``launch_server_process`` starts SGLang's server.  With slime's source
(``UNISLEEP_SLIME_SOURCE=/path/to/slime``) the train actors are made by slime's own
``_create_placement_group`` and ``RayTrainGroup._allocate_gpus_for_actor`` (offload on); only the
actor class is a stand-in for Megatron's (``actor_cls``, slime's own parameter), and it pauses and
resumes a model through the facade.  SGLang's server itself cannot run on a CPU (sgl_kernel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")

from unisleep.compat import shim_dir  # noqa: E402
from unisleep.compat.torch_memory_saver import native_library_path  # noqa: E402
from unisleep.errors import InvalidArgumentError  # noqa: E402
from unisleep.integrations.slime import runtime_env_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLIME = os.environ.get("UNISLEEP_SLIME_SOURCE", "")
HAVE_SLIME = os.path.isfile(os.path.join(SLIME, "slime", "ray", "actor_group.py"))
_spec = __import__("importlib.util").util.find_spec("sglang")
ADAPTER = (os.path.join(_spec.submodule_search_locations[0], "srt", "utils", "torch_memory_saver_adapter.py")
           if _spec else "")

#: slime's own RUNTIME_ENV_JSON (scripts/run-qwen3-4B.sh: Megatron-LM's folder on PYTHONPATH), with this
#: source tree after it, as an installed unisleep would be on the path anyway
MEGATRON = "/nonexistent/Megatron-LM/"
SLIME_JSON = json.dumps({"env_vars": {"PYTHONPATH": f"{MEGATRON}:{ROOT}", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                                      "NCCL_NVLS_ENABLE": "0"}})

#: what Ray's job supervisor does before the entrypoint runs: the runtime env's env_vars, expanded
#: by Ray's own function, in the driver's environment
_LAUNCH = """
import json, os, sys
from ray._private.utils import update_envs
update_envs(json.loads(os.environ["RUNTIME_ENV_JSON"])["env_vars"])
os.execv(sys.executable, [sys.executable, sys.argv[1]])
"""

_DRIVER = r'''
import importlib.util, json, multiprocessing, os, runpy, sys, types
import ray

runtime_env = json.loads(os.environ["RUNTIME_ENV_JSON"])
out = {"driver_pythonpath": os.environ.get("PYTHONPATH", "")}
try:
    import torch_memory_saver
    out["driver"] = type(torch_memory_saver.torch_memory_saver).__module__
except ImportError as e:
    out["driver"] = "ImportError: " + str(e)
ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)


def load_sglang_adapter():
    spec = importlib.util.spec_from_file_location("sglang_tms_adapter", os.environ["SGLANG_ADAPTER"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class SGLangEngineStandIn:
    def info(self):
        out = {"own": os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH"), "tms": os.environ.get("UNISLEEP_TMS"),
               "pythonpath": os.environ.get("PYTHONPATH", "")}
        try:
            adapter = load_sglang_adapter().TorchMemorySaverAdapter.create(enable=True)
            import torch_memory_saver
            out["module"] = type(torch_memory_saver.torch_memory_saver).__module__
            out["enabled"] = adapter.enabled
        except BaseException as e:
            out["module"] = f"{type(e).__name__}: {e}"
            return out
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        # the target must be importable in the child, as SGLang's launch_server is: runpy's
        p = ctx.Process(target=runpy.run_path, args=(os.environ["SGLANG_SERVER"],), kwargs={"init_globals": {"q": q}})
        p.start()
        out["server"] = q.get(timeout=120)
        p.join(60)
        return out


Engine = ray.remote(SGLangEngineStandIn)
engine = Engine.options(num_cpus=0, runtime_env={"env_vars": {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true"}}).remote()
out["sglang_actor"] = ray.get(engine.info.remote(), timeout=240)

if os.environ.get("UNISLEEP_SLIME_SOURCE"):
    sys.path.append(os.environ["UNISLEEP_SLIME_SOURCE"])
    from slime.ray.actor_group import RayTrainGroup
    from slime.ray.placement_group import _create_placement_group

    class MegatronActorStandIn:  # slime's actor_cls: Megatron's MegatronTrainRayActor needs GPUs
        def __init__(self, world_size, rank, master_addr, master_port):
            self.master_addr, self.master_port = "127.0.0.1", 0

        def get_master_addr_and_port(self):
            return self.master_addr, self.master_port

        def offload_cycle(self):
            import torch
            from torch_memory_saver import torch_memory_saver as tms
            got = {"module": type(tms).__module__, "ld_preload": os.environ.get("LD_PRELOAD"),
                   "tms_init": os.environ.get("TMS_INIT_ENABLE"), "tms": os.environ.get("UNISLEEP_TMS")}
            w = torch.full((1 << 20,), 7.0)
            before = tms.resident_bytes()
            tms.pause()
            got["resident_before"], got["resident_paused"] = before, tms.resident_bytes()
            tms.resume()
            got["restored"] = bool(torch.all(w == 7.0))
            return got

    args = types.SimpleNamespace(train_env_vars={}, offload_train=True, train_backend="megatron",
                                 use_routing_replay=False, rollout_data_transport="object-store")
    pg = _create_placement_group(1)
    group = RayTrainGroup(args, num_nodes=1, num_gpus_per_node=1, pg=pg, num_gpus_per_actor=0.4,
                          actor_cls=MegatronActorStandIn)
    group._allocate_gpus_for_actor(group._pg, group._num_gpus_per_actor)
    out["train_actor"] = ray.get(group._actor_handlers[0].offload_cycle.remote(), timeout=240)
ray.shutdown()
print("RESULT " + json.dumps(out))
'''


#: what slime's launch_server_process starts with spawn: SGLang's server process (SGLang's adapter in it)
_SERVER = """
import importlib.util, os
try:
    spec = importlib.util.spec_from_file_location("sglang_tms_adapter", os.environ["SGLANG_ADAPTER"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    adapter = mod.TorchMemorySaverAdapter.create(enable=True)
    import torch_memory_saver
    q.put({"module": type(torch_memory_saver.torch_memory_saver).__module__, "enabled": adapter.enabled})
except BaseException as e:
    q.put({"error": f"{type(e).__name__}: {e}"})
"""


def _submit(tmp_path, runtime_env: str, slime: bool = False) -> dict:
    driver = tmp_path / "train.py"
    driver.write_text(_DRIVER)
    (tmp_path / "sglang_server.py").write_text(_SERVER)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TMS_", "RAY_")) and k not in ("UNISLEEP_TMS", "LD_PRELOAD", "PYTHONPATH")}
    # the Ray head's own environment: unisleep importable (this source tree), nothing of the facade
    env.update(RUNTIME_ENV_JSON=runtime_env, PYTHONPATH=ROOT, UNISLEEP_PLATFORM="host", SGLANG_ADAPTER=ADAPTER,
               SGLANG_SERVER=str(tmp_path / "sglang_server.py"),
               UNISLEEP_SLIME_SOURCE=SLIME if slime else "")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(_LAUNCH), str(driver)], capture_output=True, text=True,
                       env=env, timeout=420, cwd=str(tmp_path))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_runtime_env_json_adds_the_two_variables_and_keeps_slimes():
    got = json.loads(runtime_env_json(SLIME_JSON))
    assert got == {"env_vars": {"PYTHONPATH": f"{shim_dir()}:{MEGATRON}:{ROOT}",
                                "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0", "UNISLEEP_TMS": "1"}}
    assert json.loads(runtime_env_json(runtime_env_json(SLIME_JSON))) == got  # idempotent
    assert json.loads(runtime_env_json("")) == {"env_vars": {"UNISLEEP_TMS": "1",
                                                             "PYTHONPATH": shim_dir() + ":${PYTHONPATH}"}}
    keep = json.loads(runtime_env_json('{"pip": ["x"], "env_vars": {"A": "b"}}'))
    assert keep["pip"] == ["x"] and keep["env_vars"]["A"] == "b"


@pytest.mark.parametrize("bad", ["[1]", "{not json", '{"env_vars": ["A"]}', '{"env_vars": {"A": 1}}'])
def test_runtime_env_json_refuses_what_ray_would_refuse_by_name(bad):
    with pytest.raises(InvalidArgumentError, match="RUNTIME_ENV_JSON"):
        runtime_env_json(bad)


@pytest.mark.slow
def test_the_cli_prints_the_line_slimes_scripts_use():
    p = subprocess.run([sys.executable, "-m", "unisleep.integrations.slime", SLIME_JSON], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == json.loads(runtime_env_json(SLIME_JSON))
    p = subprocess.run([sys.executable, "-m", "unisleep.integrations.slime", "[1]"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 2 and "must be a JSON object" in p.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(ADAPTER), reason="sglang is not installed (make test installs "
                                                         "sglang==0.5.10.post1 --no-deps)")
def test_the_json_reaches_the_driver_and_slimes_sglang_actors_and_their_server_children(tmp_path):
    got = _submit(tmp_path, runtime_env_json(SLIME_JSON), slime=HAVE_SLIME)
    facade = "unisleep.compat.torch_memory_saver"
    assert got["driver"] == facade, got
    assert got["driver_pythonpath"] == f"{shim_dir()}:{MEGATRON}:{ROOT}", got
    actor = got["sglang_actor"]
    # the actor's own env_vars merged over the job's: both there
    assert actor["own"] == "true" and actor["tms"] == "1" and actor["pythonpath"].startswith(shim_dir()), actor
    assert actor["module"] == facade and actor["enabled"] is True, actor
    assert actor["server"] == {"module": facade, "enabled": True}, actor
    if HAVE_SLIME:
        train = got["train_actor"]
        assert train["module"] == facade and train["ld_preload"] == native_library_path(), train
        assert train["tms_init"] == "1" and train["tms"] == "1", train
        assert train["resident_before"] >= 4 << 20 and train["resident_paused"] == 0 and train["restored"], train


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(ADAPTER), reason="sglang is not installed (make test installs "
                                                         "sglang==0.5.10.post1 --no-deps)")
def test_without_the_variables_neither_the_driver_nor_the_sglang_actor_has_torch_memory_saver(tmp_path):
    """The control: slime's own JSON as it is. Nothing here installs torch_memory_saver, so the
    imports fail — the facade above came through the JSON and nothing else."""
    got = _submit(tmp_path, SLIME_JSON)
    assert got["driver"].startswith("ImportError"), got
    assert got["sglang_actor"]["module"].startswith(("ImportError", "ModuleNotFoundError")), got
