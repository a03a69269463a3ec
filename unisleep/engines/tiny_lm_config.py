"""The embedded engine's model shape (:class:`TinyLMConfig`), apart from the model so that the
command line can check options against it without importing torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    max_len: int = 32
    seed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


__all__ = ["TinyLMConfig"]
