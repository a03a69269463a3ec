"""Adoption: moving the storage of existing tensors into lifecycle memory, in place.

:func:`tensors_of` finds and checks every tensor of an object (module, optimizer, mapping...),
:func:`pack` groups them by storage (tied weights and views stay tied) and lays the storages out
in one region, refusing a storage some of whose tensors were not passed; :func:`move` copies the
bytes and points every tensor at its new home, all or nothing, and records which names are a
module's buffers (kept across a level-2 sleep like preserved parameters: a rotary embedding's
``inv_freq`` is computed at construction and is in no checkpoint to reload).  Nothing here takes a lock: the
lifecycle calls :func:`pack` and :func:`move` under its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from ..errors import InvalidArgumentError
from ..region import round_up
from ..units import human_bytes

#: byte alignment of the storages packed into one region
ALIGN = 512


@dataclass
class Packing:
    """Where each storage goes in the new region: ``storages`` maps a storage key (device,
    address, bytes) to the ``(names, tensor)`` pairs passed on it; ``offsets`` to its offset."""

    storages: dict
    offsets: dict
    total: int  # bytes of the region
    buffers: set  # the names that are a module's buffers


def shape_bytes(shape, dtype) -> tuple[tuple, Any, int]:
    """``(shape, dtype, nbytes)`` of ``empty(shape, dtype)`` (dtype None: float32), checked:
    :class:`~unisleep.errors.InvalidArgumentError` for anything else than ints >= 0 and a
    torch dtype."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    for s in shape:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise InvalidArgumentError(f"shape must hold ints >= 0, got {shape!r}")
    numel = 1
    for s in shape:
        numel *= int(s)
    return shape, dtype, numel * torch.empty((), dtype=dtype).element_size()


def tensors_of(obj) -> list[tuple[str, Any, bool]]:
    """``(name, tensor, is_buffer)`` of every tensor of ``obj`` (``is_buffer``: a module's
    buffer), each checked for adoption; raises :class:`~unisleep.errors.InvalidArgumentError`
    (nothing moved) otherwise."""
    named = list(_named_tensors(obj))
    if not named:
        raise InvalidArgumentError(f"adopt() found no tensors in {type(obj).__name__}")
    for name, t, _ in named:  # everything is checked before anything moves
        why = _cannot_adopt(t)
        if why:
            raise InvalidArgumentError(f"adopt() cannot move {name!r}: {why}. Nothing was moved.")
    return named


def pack(named: list[tuple[str, Any, bool]]) -> Packing:
    """One slot per distinct storage, so tied weights and views stay tied."""
    aliases: dict[int, tuple[Any, list[str]]] = {}  # every name of each tensor object (a tied weight has several)
    for name, t, _ in named:
        aliases.setdefault(id(t), (t, []))[1].append(name)
    storages: dict[tuple, list[tuple[list[str], Any]]] = {}
    for t, names in aliases.values():
        st = t.untyped_storage()
        storages.setdefault((t.device, st.data_ptr(), st.nbytes()), []).append((names, t))
    _check_storages_passed_whole(storages)
    offsets, total = {}, 0
    for key in storages:
        offsets[key] = total
        total = round_up(total + max(key[2], 1), ALIGN)
    return Packing(storages, offsets, total, {name for name, _, is_buffer in named if is_buffer})


def move(packing: Packing, alloc, base, device, keep: Callable[[Any], Any]) -> None:
    """Copy every storage of ``packing`` into ``base`` (the uint8 view of ``alloc``'s region)
    and point each tensor at its new bytes (``keep(t)`` makes it hold the allocation's keeper);
    records each name's byte range in ``alloc.names``.  On failure every tensor is put back on
    its old storage and the error re-raised.  The names of module buffers go to ``alloc.kept``."""
    import torch

    moved_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for key, members in packing.storages.items():
            off, nbytes = packing.offsets[key], key[2]
            src = members[0][1]
            src_bytes = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src.untyped_storage())
            base[off : off + nbytes].copy_(src_bytes)
            new_storage = base[off : off + nbytes].untyped_storage()
            for names, t in members:
                # the region's storage starts at its va; element offset of this tensor in it
                elem = t.element_size()
                byte_off = (base.data_ptr() + off - new_storage.data_ptr()) + t.storage_offset() * elem
                moved = torch.empty(0, dtype=t.dtype, device=device).set_(new_storage, byte_off // elem, t.size(),
                                                                          t.stride())
                old = t.data
                with torch.no_grad():
                    t.data = moved
                moved_back.append((t, old))
                keep(t)
                # byte range in the region: byte_off is already region-relative (the storage
                # starts at the region's va); the extent covers strided views too
                extent = 1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()))
                for name in names:
                    alloc.names[name] = (byte_off, extent * elem)
        alloc.kept.update(packing.buffers)
    except BaseException:
        with torch.no_grad():
            for t, old in reversed(moved_back):
                t.data = old
        raise


def _cannot_adopt(t) -> Optional[str]:
    import torch

    if t.device.type == "meta":
        return "it is a meta tensor (no data); materialise the model first (e.g. to_empty() and load the weights)"
    if t.layout != torch.strided:
        return f"its layout is {t.layout} (sparse or otherwise not strided); only dense tensors can be adopted"
    if t.is_quantized:
        return "it is a quantized tensor; adopt the dequantized or packed storage instead"
    try:
        t.untyped_storage()
    except Exception as e:  # any failure to reach a plain storage is the reason returned
        return f"it has no plain storage ({e})"
    return None


def _check_storages_passed_whole(storages: dict) -> None:
    """Refuse (before anything moves) a storage some of whose tensors were not passed to
    ``adopt()``; ``storages`` maps each storage to its passed ``(names, tensor)`` pairs.

    Each tensor on a storage holds one reference to it: a count above the passed tensors (and
    the bases their views keep alive) is another tensor — an unpassed view, a held
    ``state_dict()`` entry, a ``.data``/``.detach()`` alias.  A passed view whose base was not
    passed is refused when that base is held by anyone else than its views (a variable, a
    module); a base only its views keep alive (``torch.arange(n).reshape(a, b)``) is nobody's
    to track and moves with them."""
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    probe = _base_refs(torch.empty(2)[:1])  # an unheld base kept alive by one view: the baseline
    for members in storages.values():
        ids = {id(t) for _, t in members}
        views: dict[int, list] = {}  # id of an unpassed base -> [(names, view)] of passed views
        for names, t in members:
            if t._base is not None and id(t._base) not in ids:
                views.setdefault(id(t._base), []).append((names, t))
        if use_count is not None:
            st = members[0][1].untyped_storage()
            extra = use_count(st._cdata) - 1 - len(ids) - len(views)  # 1: ``st`` itself
            nbytes = st.nbytes()
            del st
            if extra > 0:
                names = [n for ns, _ in members for n in ns]
                shown = ", ".join(map(repr, names[:4])) + (" ..." if len(names) > 4 else "")
                raise InvalidArgumentError(
                    f"adopt() cannot move {shown}: {extra} other tensor(s) share its storage ({human_bytes(nbytes)}) "
                    "but were not passed — a view of it, the tensor it is a view of, or an alias such as a held "
                    "state_dict() entry, .data or .detach(); after the move they would keep pointing at the old "
                    "memory and silently stop tracking it. Pass them in the same adopt() call (e.g. adopt the whole "
                    "module, or adopt({'base': t, 'view': v})), or drop them (del) first. Nothing was moved."
                )
        for passed in views.values():
            names, t = passed[0]
            refs = _base_refs(t)
            if refs[0] > probe[0] or (refs[1] >= 0 and refs[1] - (len(passed) - 1) > probe[1]):
                raise InvalidArgumentError(
                    f"adopt() cannot move {names[0]!r}: it is a view (shape {tuple(t.shape)}) of a tensor of shape "
                    f"{tuple(t._base.shape)} that was not passed and is still in use; moved alone it would leave "
                    "that base tensor on the old memory and the two would silently stop sharing their bytes. Pass "
                    f"the base tensor in the same adopt() call (e.g. adopt({{'base': base, {names[0]!r}: view}}), "
                    "or adopt the module that owns it), or pass view.clone() to adopt an independent copy. Nothing "
                    "was moved."
                )


def _base_refs(view) -> tuple[int, int]:
    """(Python references, tensor references) of ``view``'s base, as seen from here."""
    b = view._base
    uc = getattr(b, "_use_count", None)
    return sys.getrefcount(b), (uc() if uc is not None else -1)


def _named_tensors(obj, prefix: str = "") -> Iterator[tuple[str, Any, bool]]:
    import torch

    seen: set[tuple[int, str]] = set()

    def emit(name, t, is_buffer=False):  # the same tensor may come under several names (tied weights)
        if isinstance(t, torch.Tensor) and (id(t), name) not in seen and t.numel() > 0:
            seen.add((id(t), name))
            yield name, t, is_buffer

    def walk(o, pre):
        if isinstance(o, torch.Tensor):
            yield from emit(pre or "tensor", o)
        elif isinstance(o, torch.nn.Module):
            for n, p in o.named_parameters(remove_duplicate=False):
                yield from emit(_join(pre, n), p)
            for n, b in o.named_buffers(remove_duplicate=False):
                yield from emit(_join(pre, n), b, True)
        elif isinstance(o, torch.optim.Optimizer):
            for i, (p, st) in enumerate(o.state.items()):
                for k, v in st.items():
                    yield from emit(_join(pre, f"state.{i}.{k}"), v)
        elif isinstance(o, Mapping):
            for k, v in o.items():
                yield from walk(v, _join(pre, str(k)))
        elif isinstance(o, Iterable) and not isinstance(o, (str, bytes)):
            for i, v in enumerate(o):
                yield from walk(v, _join(pre, str(i)))

    yield from walk(obj, prefix)


def _join(pre: str, name: str) -> str:
    return f"{pre}.{name}" if pre else name
