"""Adapters that plug unisleep into RL frameworks at their own extension points.

One module per framework; importing this package imports no framework — each module imports
its framework when it is itself imported (which the framework does, through its configuration):

* :mod:`unisleep.integrations.verl` — a verl checkpoint engine (``checkpoint_engine.backend:
  unisleep``, ``checkpoint_engine.custom_backend_module: unisleep.integrations.verl``);
* :mod:`unisleep.integrations.openrlhf` — an OpenRLHF vLLM worker extension
  (``worker_extension_cls``) and the trainer's model-update group;
* :mod:`unisleep.integrations.sglang` — SGLang's ``update_weights_from_tensor`` /
  ``update_weights_from_distributed`` fed by a verified unisleep update;
* :mod:`unisleep.integrations.slime`, :mod:`unisleep.integrations.areal` — the environment their
  launchers give the torch_memory_saver facade.

docs/integrations/ says, per framework, what a user changes and what was run where.
"""
