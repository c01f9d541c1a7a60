"""Where the decoding cache keeps its keys: [N slots, P positions, D] rows written and read by
(slot, position) indices. `KeyPool` holds them as they are; `Fp8KeyPool` (model.kv_quant: fp8)
as DeepSeek's runtime caches K = V: the non-RoPE channels in FP8 with an fp32 scale per block
of 64 (ops.fp8_kv_quant), the RoPE channels in the model's dtype, 0.59x the bytes of bf16 rows
at V4's 448 + 64 channels. Both give back rows in the model's dtype.

A row a pool is given is quantized as it is written (the model's K = V already lies on the FP8
grid under kv_quant, so the codes are the forward's and the scale within an ulp of it);
`put(.., when=)` keeps the other rows' stored bits untouched rather than rounding them again.
"""

from __future__ import annotations

import torch

from . import ops


class KeyPool:
    """Rows [N, P, D] as they are (the model's dtype; fp32 for the indexer's entries)."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    @classmethod
    def zeros(cls, slots: int, positions: int, dim: int, dtype: torch.dtype, device) -> KeyPool:
        return cls(torch.zeros(slots, positions, dim, dtype=dtype, device=device))

    @property
    def shape(self) -> torch.Size:
        return self.t.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    def tensors(self) -> list[torch.Tensor]:
        """The storage, slot dimension first."""
        return [self.t]

    def positions(self, start: int) -> KeyPool:
        """Positions start.. of every slot, sharing this pool's storage."""
        return KeyPool(self.t[:, start:])

    def put(self, index: tuple, rows: torch.Tensor, when: torch.Tensor | None = None) -> None:
        """Write rows [..., D] at index (slots, positions); with `when` [B] only those rows."""
        rows = rows.to(self.t.dtype)
        self.t[index] = rows if when is None else torch.where(when[:, None], rows, self.t[index])

    def get(self, index: tuple) -> torch.Tensor:
        return self.t[index]

    def attend(self, q: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float, options) -> torch.Tensor:
        """The sparse-attention kernel's o [B, H, D] for q [B, H, D] over the rows idx [B, K]
        names in the flattened pool (-1 = none), read in place."""
        from .kernels.sparse_attention import sparse_attention

        return sparse_attention(q, self.t.view(-1, self.t.shape[-1]), idx, sink, scale, options=options)[0]


class Fp8KeyPool:
    """Rows [N, P, D] with their first D - rope channels in FP8 (uint8 codes [N, P, d] and fp32
    scales [N, P, d / 64]) and their last `rope` channels in `dtype`."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor):
        self.codes, self.scales, self.rope = codes, scales, rope

    @classmethod
    def zeros(cls, slots: int, positions: int, dim: int, rope: int, dtype: torch.dtype, device) -> Fp8KeyPool:
        d = dim - rope
        codes, scales = ops.fp8_kv_quant(torch.zeros(1, 1, dim, device=device), rope)
        return cls(torch.zeros(slots, positions, d, dtype=torch.uint8, device=device),
                   torch.zeros(slots, positions, scales.shape[-1], dtype=torch.float32, device=device),
                   torch.zeros(slots, positions, rope, dtype=dtype, device=device))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:2], self.codes.shape[-1] + self.rope.shape[-1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.rope.dtype

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales, self.rope]

    def positions(self, start: int) -> Fp8KeyPool:
        return Fp8KeyPool(self.codes[:, start:], self.scales[:, start:], self.rope[:, start:])

    def put(self, index: tuple, rows: torch.Tensor, when: torch.Tensor | None = None) -> None:
        rope = self.rope.shape[-1]
        codes, scales = ops.fp8_kv_quant(rows, rope)
        new = (codes, scales, rows[..., rows.shape[-1] - rope:].to(self.rope.dtype))
        for store, value in zip(self.tensors(), new, strict=True):
            store[index] = value if when is None else torch.where(when[:, None], value, store[index])

    def get(self, index: tuple) -> torch.Tensor:
        nope = ops.fp8_kv_dequant(self.codes[index], self.scales[index], self.rope.dtype)
        return torch.cat((nope, self.rope[index]), -1)

    def attend(self, q: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float, options) -> torch.Tensor:
        """KeyPool.attend over the codes, scales and RoPE channels in place: the kernel
        dequantizes the rows it reads in registers (no bf16 copy of them). Its forward only:
        the pool is a decoding cache."""
        from .kernels.sparse_attention import sparse_attention_fp8

        flat = [t.view(-1, t.shape[-1]) for t in self.tensors()]
        return sparse_attention_fp8(q, *flat, idx, sink, scale)[0]
