"""OpenRLHF 0.11.0's own trainer-side weight sync, run in a Ray actor as OpenRLHF's
``PolicyModelActor`` runs it: ``ActorPPOTrainer.__init__`` (which decides ``use_cuda_ipc`` and,
at DeepSpeed rank 0, calls ``_init_vllm_sync_group``) and ``ActorPPOTrainer.broadcast_to_vllm``,
imported from ``openrlhf.trainer.ray.ppo_actor`` and called unchanged.

What cannot run on this CPU-only environment stands in, and nothing else:

* **packages OpenRLHF imports but the sync never calls** — ``deepspeed``, ``peft``,
  ``torchdata`` and ``flash_attn`` are not installed (OpenRLHF is installed ``--no-deps``;
  DeepSpeed and flash-attn need CUDA builds): each is an empty module so that
  ``ppo_actor`` imports.  The one DeepSpeed call on the sync path,
  ``deepspeed.zero.GatheredParameters([param], enabled=zero_stage == 3)``, stands in as ZeRO-1/2
  (it refuses ``enabled=True``): a context that gathers nothing, which is what DeepSpeed's does
  when not enabled.
* **DeepSpeed's engine** — ``actor.model.module`` is the Hugging Face model itself
  (``LlamaForCausalLM`` from the tiny checkpoint), which is what DeepSpeed's engine wraps.
* **CUDA** — this torch has none: ``torch.cuda.current_device`` returns 0 (OpenRLHF passes it to
  ``stateless_init_process_group`` as the device), ``torch.cuda.current_stream`` returns None
  (the stream ``broadcast`` is given), ``torch.cuda.synchronize`` does nothing.
* **DeepSpeed's data-parallel group** — a real gloo ``torch.distributed`` group of one rank.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from types import SimpleNamespace as NS

#: not installed with OpenRLHF here; OpenRLHF's trainer modules import them
ABSENT = ("deepspeed", "peft", "torchdata", "flash_attn")


class _Empty(types.ModuleType):
    """An absent package's module: any name is an inert class (only imported, never used)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _AbsentFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in ABSENT:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Empty(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def _gathered_parameters(params, enabled=False, **kwargs):
    if enabled:
        raise AssertionError("the DeepSpeed stand-in is ZeRO-1/2 only (no ZeRO-3 gathering)")
    yield


def _stand_ins() -> None:
    import torch

    for name in ABSENT:
        try:
            __import__(name)
            raise AssertionError(f"{name} is installed: the stand-in would hide it")
        except ImportError:
            pass
    sys.meta_path.insert(0, _AbsentFinder())
    import deepspeed

    deepspeed.zero.GatheredParameters = _gathered_parameters
    torch.cuda.current_device = lambda: 0
    torch.cuda.current_stream = lambda device=None: None
    torch.cuda.synchronize = lambda device=None: None


def _args(*, sync_backend: str, colocate_all: bool, async_enable: bool, num_engines: int,
          sync_with_ray: bool = False):
    """The fields of OpenRLHF's parsed arguments that ActorPPOTrainer reads, at its defaults."""
    return NS(
        vllm=NS(sync_backend=sync_backend, num_engines=num_engines, tensor_parallel_size=1,
                sync_with_ray=sync_with_ray, enable_prefix_caching=False),
        train=NS(colocate_all=colocate_all, async_enable=async_enable, max_epochs=1,
                 dynamic_batch_enable=False),
        ds=NS(zero_stage=2, tensor_parallel_size=1, packing_samples=False),
        actor=NS(eps_clip_low_high=(0.2, 0.2), dual_clip=None, policy_loss_type="ppo",
                 aux_loss_coef=0.0),
        algo=NS(advantage=NS(is_correction_enable=False, is_correction_threshold=None,
                             is_correction_type="tis")),
    )


class OpenRLHFTrainer:
    """A Ray actor holding OpenRLHF's ``ActorPPOTrainer`` over ``engines`` (OpenRLHF's
    ``RolloutRayActor`` handles)."""

    def __init__(self, engines, *, sync_backend: str = "nccl", colocate_all: bool = True,
                 async_enable: bool = False, sync_with_ray: bool = False) -> None:
        _stand_ins()
        import torch.distributed as dist

        from unisleep.engines.vllm_server import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                                rank=0, world_size=1)
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        strategy = NS(args=_args(sync_backend=sync_backend, colocate_all=colocate_all,
                                 async_enable=async_enable, num_engines=len(engines),
                                 sync_with_ray=sync_with_ray))
        self.actor = NS(model=NS(module=None))  # DeepSpeed's engine: .module is the HF model
        self.trainer = ActorPPOTrainer(strategy, self.actor, None, None, None,
                                       micro_train_batch_size=1, vllm_engines=list(engines))

    def state(self) -> dict:
        t = self.trainer
        return {"use_cuda_ipc": t.use_cuda_ipc,
                "ipc_requested": getattr(t, "_unisleep_openrlhf_ipc_requested", None),
                "group": type(getattr(t, "_model_update_group", None)).__name__}

    def broadcast_to_vllm(self, model_dir: str, frozen: tuple = ()) -> int:
        """Load the checkpoint at ``model_dir`` as the trained model (float32, the engine's
        dtype), then run OpenRLHF's ``broadcast_to_vllm``; returns the parameters it holds.
        ``frozen``: parameters (name suffixes) OpenRLHF leaves out of the sync — those of a
        vision-language actor's frozen part: ``actor.is_vlm`` and ``requires_grad=False``, the
        filter OpenRLHF's own loop applies."""
        import torch
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        for name, p in model.named_parameters():
            p.requires_grad_(not any(name.endswith(f) for f in frozen))
        self.actor.is_vlm = bool(frozen)
        self.actor.model.module = model
        self.trainer.broadcast_to_vllm()
        return sum(1 for _ in model.named_parameters())

    def updates(self) -> int:
        """The unisleep updates the trainer's group has sent so far."""
        return self.trainer._model_update_group._n

    def close(self) -> None:
        group = getattr(self.trainer, "_model_update_group", None)
        if group is not None and hasattr(group, "close"):
            group.close()
