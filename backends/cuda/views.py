"""Device memory as torch tensors: an address range exposed through
``__cuda_array_interface__``, which ``torch.as_tensor`` wraps without a copy."""

from __future__ import annotations


class DeviceBuffer:
    """Exposes ``[ptr, ptr+n)`` through ``__cuda_array_interface__`` so torch can wrap it;
    ``owner`` lives as long as the tensor's storage."""

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, ptr: int, n: int, owner=None):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        self.owner = owner  # torch keeps this object alive as long as the tensor's storage
