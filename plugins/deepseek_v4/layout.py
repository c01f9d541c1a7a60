"""Which token sees which: documents, positions, windows and compression blocks.

One `SequenceLayout` is built per forward from padding or packing information and
shared by all layers. Every mask is derived from two per-token facts: the document id
(-1 = padding, attends to and is seen by nothing) and the position inside its
document (RoPE position, and the origin of compression blocks). So padding never pools
into a block, packed documents never see each other, and a padded row computes exactly
what the same row computes alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def sort_key_dtype(limit: int) -> torch.dtype:
    """The narrowest signed integer type holding sort keys 0 .. limit - 1 (a radix sort takes a
    pass per few bits of its key type)."""
    return next(t for t in (torch.int16, torch.int32, torch.int64) if limit - 1 <= torch.iinfo(t).max)


@dataclass
class Blocks:
    """Complete compression blocks of ratio r, compacted per row to G = max count.

    start [B, G]: global index of the block's first token; valid [B, G];
    has_prev [B, G]: the block has a previous block in its document (CSA overlap);
    pos [B, G]: in-document position of the first token (the entry's RoPE position g*r);
    end [B, G]: global index of the last token (entry visible to queries at index >= end).
    """

    ratio: int
    start: torch.Tensor
    valid: torch.Tensor
    has_prev: torch.Tensor
    pos: torch.Tensor
    end: torch.Tensor
    doc: torch.Tensor

    @property
    def count(self) -> int:
        return self.start.shape[1]

    def token_index(self, offset: int = 0) -> torch.Tensor:
        """[B, G, r] global token indices of the block shifted by `offset` blocks (clamped)."""
        idx = self.start[..., None] + offset * self.ratio + torch.arange(self.ratio, device=self.start.device)
        return idx.clamp(0, None)


@dataclass
class SequenceLayout:
    doc: torch.Tensor  # [B, S] int64 document id, -1 = padding
    pos: torch.Tensor  # [B, S] int64 position inside the document
    # G = S // r blocks a row (a static shape: no wait for the GPU, CUDA graphs) instead of the
    # most complete blocks any row has; the extra entries are invalid and seen by no query
    static_blocks: bool = False
    _blocks: dict[int, Blocks] = field(default_factory=dict, repr=False)
    _windows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _window_idx: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, batch: int, seq: int, device: torch.device, attention_mask: torch.Tensor | None = None,
              doc_ids: torch.Tensor | None = None, static_blocks: bool = False) -> SequenceLayout:
        """attention_mask [B, S] (1 = token, 0 = padding, any side) or doc_ids [B, S]
        (packed documents: equal ids in contiguous runs, -1 = padding)."""
        if attention_mask is not None and doc_ids is not None:
            raise ValueError("pass attention_mask or doc_ids, not both")
        if doc_ids is None:
            if attention_mask is None:
                doc = torch.zeros(batch, seq, dtype=torch.long, device=device)
            else:
                doc = torch.where(attention_mask.bool(), 0, -1).long()
        else:
            doc = doc_ids.long()
        if doc.shape != (batch, seq):
            raise ValueError(f"layout: expected [{batch}, {seq}] document ids, got {list(doc.shape)}")
        # A new document (or padding run) starts where the id changes.
        idx = torch.arange(seq, device=device).expand(batch, seq)
        starts = torch.ones_like(doc, dtype=torch.bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        run_start = torch.cummax(torch.where(starts, idx, 0), dim=1).values
        pos = torch.where(doc >= 0, idx - run_start, 0)
        return cls(doc=doc, pos=pos, static_blocks=static_blocks)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.doc.shape)

    def window_mask(self, window: int) -> torch.Tensor:
        """[B, S, S]: key k visible to query q iff same document, k <= q, q - k < window."""
        if window not in self._windows:
            b, s = self.shape
            idx = torch.arange(s, device=self.doc.device)
            diff = idx[:, None] - idx[None, :]  # q - k
            same = (self.doc[:, :, None] == self.doc[:, None, :]) & (self.doc[:, :, None] >= 0)
            self._windows[window] = same & ((diff >= 0) & (diff < window))[None]
        return self._windows[window]

    def window_index(self, window: int) -> torch.Tensor:
        """[B, S, W] the keys of window_mask as indices (query q, slot j: key q - j), -1 where
        that key is not visible; no [S, S] tensor is built."""
        if window not in self._window_idx:
            b, s = self.shape
            k = torch.arange(s, device=self.doc.device)[:, None] - torch.arange(window, device=self.doc.device)
            kc = k.clamp_min(0).expand(b, s, window)  # [B, S, W]
            same = (self.doc.gather(1, kc.reshape(b, -1)).view(b, s, window) == self.doc[:, :, None]) & (
                self.doc[:, :, None] >= 0)
            self._window_idx[window] = torch.where(same & (k >= 0), k, -1)
        return self._window_idx[window]

    def blocks(self, ratio: int) -> Blocks:
        if ratio not in self._blocks:
            self._blocks[ratio] = _complete_blocks(self.doc, self.pos, ratio, self.static_blocks)
        return self._blocks[ratio]

    def entry_bound(self, blocks: Blocks) -> torch.Tensor:
        """[B, S] int32: how many valid blocks end at or before each query, so every entry
        `visible` gives it lies below (blocks are in start order, the valid ones first); an
        earlier document's entries below it are the visibility mask's to drop. O(S log G): no
        [B, S, G] tensor (the indexer's scores take it to skip the tiles past it)."""
        b, s = self.shape
        idx = torch.arange(s, device=self.doc.device).expand(b, s).contiguous()
        return torch.searchsorted(blocks.end.contiguous(), idx, right=True).to(torch.int32)

    def visible(self, blocks: Blocks) -> torch.Tensor:
        """[B, S, G]: compressed entry g visible to query p iff same document and the
        block's last token is at or before p (block g < floor((p+1)/r))."""
        s = self.shape[1]
        idx = torch.arange(s, device=self.doc.device)
        same = self.doc[:, :, None] == blocks.doc[:, None, :]
        return same & blocks.valid[:, None, :] & (blocks.end[:, None, :] <= idx[None, :, None])


def _complete_blocks(doc: torch.Tensor, pos: torch.Tensor, r: int, static: bool) -> Blocks:
    b, s = doc.shape
    dev = doc.device
    idx = torch.arange(s, device=dev).expand(b, s)
    end = idx + r - 1
    end_c = end.clamp(max=s - 1)
    complete = ((pos % r == 0) & (doc >= 0) & (end < s)
                & (doc.gather(1, end_c) == doc) & (pos.gather(1, end_c) == pos + r - 1))
    g = s // r if static else int(complete.sum(1).max().item()) if s else 0
    # Compact the block starts of each row to the front, in order (unique keys < 2s: sorted in
    # the narrowest integer type, fewer radix passes, the same order).
    key = torch.where(complete, idx, idx + s).to(sort_key_dtype(2 * s))
    order = key.sort(dim=1).indices[:, :g]
    valid = complete.gather(1, order)
    start = torch.where(valid, order, 0)
    bpos = pos.gather(1, start)
    return Blocks(ratio=r, start=start, valid=valid, has_prev=valid & (bpos >= r), pos=bpos,
                  end=torch.where(valid, start + r - 1, s), doc=torch.where(valid, doc.gather(1, start), -2))
