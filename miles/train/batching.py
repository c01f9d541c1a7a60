"""Micro-batching by token budget and sequence packing: small pure functions.

A sample is a token list with labels. `pack` concatenates samples into rows of at most
`max_tokens`, giving each sample its own document id, so attention, compression blocks
and MTP never cross samples (the model derives positions and masks from the ids).
`micro_batches` groups the packed rows so that no micro-batch exceeds the token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins.deepseek_v4.model import IGNORE_INDEX


@dataclass
class PackedRow:
    input_ids: list[int]
    labels: list[int]
    doc_ids: list[int]


def pack(samples: list[tuple[list[int], list[int]]], max_tokens: int) -> list[PackedRow]:
    """First-fit-decreasing packing of (input_ids, labels) samples into rows of <= max_tokens.
    The order of rows is deterministic (ties keep input order)."""
    rows: list[PackedRow] = []
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i][0]))
    for i in order:
        ids, lab = samples[i]
        if len(ids) != len(lab):
            raise ValueError(f"sample {i}: {len(ids)} input ids but {len(lab)} labels")
        if len(ids) > max_tokens:
            raise ValueError(f"sample {i}: {len(ids)} tokens exceed the packing budget of {max_tokens}")
        row = next((r for r in rows if len(r.input_ids) + len(ids) <= max_tokens), None)
        if row is None:
            row = PackedRow([], [], [])
            rows.append(row)
        doc = (row.doc_ids[-1] + 1) if row.doc_ids else 0
        row.input_ids += ids
        row.labels += lab
        row.doc_ids += [doc] * len(ids)
    return rows


def to_tensors(rows: list[PackedRow], pad_to_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows -> input_ids, labels, doc_ids [B, S], padded (doc id -1, label ignored) to the
    longest row rounded up to `pad_to_multiple` (e.g. the context-parallel size)."""
    s = max(len(r.input_ids) for r in rows)
    s = -(-s // pad_to_multiple) * pad_to_multiple
    ids = torch.zeros(len(rows), s, dtype=torch.long)
    lab = torch.full((len(rows), s), IGNORE_INDEX, dtype=torch.long)
    doc = torch.full((len(rows), s), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n], lab[i, :n], doc[i, :n] = torch.tensor(r.input_ids), torch.tensor(r.labels), torch.tensor(r.doc_ids)
    return ids, lab, doc


def micro_batches(row_tokens: list[int], max_tokens: int) -> list[list[int]]:
    """Group row indices, in order, so each group's padded size (rows x longest row) stays
    within `max_tokens`; a row larger than the budget is a micro-batch of its own."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(row_tokens):
        if cur and (len(cur) + 1) * max(longest, n) > max_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return groups + ([cur] if cur else [])
