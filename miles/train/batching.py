"""The trainer's micro-batch, and how samples become micro-batches (small pure functions).

`MicroBatch` is what a TrainWorker consumes: typed [B, S] tensors, validated once when made.
Samples (miles.data.sample: tokens and a per-token loss mask) become rows: one sample per
row (`replica_micro_batches`), or several packed into a row of at most `max_tokens`
positions (`pack`), each its own document, so attention, compression blocks and MTP never
cross samples (the model derives positions and masks from the document ids).
`micro_batches` groups rows so that no micro-batch exceeds a token budget.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from miles.data.sample import Sample
from miles.memory import to_device
from plugins.deepseek_v4.model import IGNORE_INDEX

# replay choices: MicroBatch field -> Sample field ([B, S, layers, slots] -> [T, layers, slots])
REPLAYED = {"routed_experts": "routes", "indexer_picks": "picks"}


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch, every tensor [B, S]. Every rank of a data-parallel replica (its TP,
    PP and CP peers) receives the same micro-batches.

    input_ids   int64 token ids.
    labels      int64: the token that position t's logits must predict (normally
                input_ids[b, t+1]); IGNORE_INDEX where there is none.
    loss_mask   float32 weight of position t in the loss: 1 trained, 0 not (prompt, padding,
                positions without a label). Losses are sums over weighted positions divided
                by the global batch's total weight.
    doc_ids     int64 packed documents (equal ids in contiguous runs, -1 = padding), or None:
                one document per row, no padding.
    advantages, old_logprobs, rollout_logprobs, ref_logprobs, token_weights
                float32 per position, for policy losses (RL): the advantage of the token
                position t predicts, its log-probability under the policy before this
                rollout's updates (None: the current one, detached), under the engine that
                sampled it, under the reference model; token_weights the aggregation weight
                (miles.algo.losses.response_weights, the global batch's normaliser included).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None  # [B, S, L, k] int16: routing replay, -1 = the trainer's own
    indexer_picks: torch.Tensor | None = None  # [B, S, C, K] indexer replay: block numbers, -1 = none

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"micro-batch: input_ids must be [B, S], got {list(shape)}")
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None and tuple(t.shape[:2] if f.name in REPLAYED else t.shape) != shape:
                raise ValueError(f"micro-batch: {f.name} has shape {list(t.shape)}, input_ids {list(shape)}")
        for name in ("input_ids", "labels") + (("doc_ids",) if self.doc_ids is not None else ()):
            if getattr(self, name).dtype != torch.long:
                raise ValueError(f"micro-batch: {name} must be int64, got {getattr(self, name).dtype}")
        if (self.loss_mask.masked_select(self.labels == IGNORE_INDEX) != 0).any():
            raise ValueError("micro-batch: loss_mask trains positions whose label is IGNORE_INDEX")

    @classmethod
    def lm(cls, input_ids: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None) -> MicroBatch:
        """Every labelled position trained (loss_mask = labels != IGNORE_INDEX)."""
        return cls(input_ids, labels, (labels != IGNORE_INDEX).float(), doc_ids)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def to(self, device: torch.device | None) -> MicroBatch:
        """This micro-batch on `device`. Not validated again (it was when made; on a GPU the
        check would make the host wait for the copy); host tensors reach a GPU from pinned
        memory without the host waiting for them either."""
        if device is None:
            return self
        moved = copy.copy(self)
        for f in fields(self):
            if (t := getattr(self, f.name)) is not None:
                object.__setattr__(moved, f.name, to_device(t, device))
        return moved

    def rows(self, start: int, stop: int) -> MicroBatch:
        """Rows [start, stop) as a micro-batch of their own."""
        return replace(self, **{f.name: getattr(self, f.name)[start:stop] for f in fields(self)
                                if getattr(self, f.name) is not None})


def positions(sample: Sample) -> int:
    """Trained-or-read positions a sample takes in a row: each token but the last predicts one."""
    return len(sample.tokens) - 1


def pack(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """First-fit-decreasing packing of samples into rows of at most `max_tokens` positions;
    each sample stays a document of its own (`to_micro_batch` gives it its own id). The
    order of rows is deterministic (ties keep input order)."""
    rows: list[list[Sample]] = []
    used: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: -positions(samples[i])):
        n = positions(samples[i])
        if n > max_tokens:
            raise ValueError(f"sample {i}: {n} positions exceed the packing budget of {max_tokens}")
        r = next((r for r, u in enumerate(used) if u + n <= max_tokens), None)
        if r is None:
            rows.append([])
            used.append(0)
            r = len(rows) - 1
        rows[r].append(samples[i])
        used[r] += n
    return rows


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


def to_micro_batch(rows: list[list[Sample]], pad_to_multiple: int = 1) -> MicroBatch:
    """Rows of samples as a micro-batch. In a row each sample is a document (ids 0, 1, ...;
    -1 = padding): position t reads tokens[t] and predicts tokens[t + 1], trained where
    loss_mask[t + 1]. Rows are padded to the longest, rounded up to `pad_to_multiple` (e.g. the
    context-parallel size). doc_ids is None when every row is one document without padding."""
    n = max(sum(positions(s) for s in row) for row in rows)
    n = -(-n // pad_to_multiple) * pad_to_multiple
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    lab = torch.full((len(rows), n), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(len(rows), n)
    doc = torch.full((len(rows), n), -1, dtype=torch.long)
    keys = sorted({k for row in rows for s in row for k in s.values})
    if any(set(s.values) != set(keys) for row in rows for s in row):
        raise ValueError(f"samples of one micro-batch carry different per-token values (some lack one of {keys})")
    extra = {k: torch.zeros(len(rows), n) for k in keys}
    for name, key in REPLAYED.items():  # [B, n, L, k] / [B, n, C, K]: the token each position reads', -1 on padding
        carried = [getattr(s, key) is not None for row in rows for s in row]
        if any(carried) and not all(carried):
            raise ValueError(f"samples of one micro-batch differ: some carry replay {key}, some do not")
        if all(carried):
            like = getattr(rows[0][0], key)
            dtype = torch.int16 if like.dtype == np.int16 else torch.int32
            extra[name] = torch.full((len(rows), n, *like.shape[1:]), -1, dtype=dtype)
    for i, row in enumerate(rows):
        at = 0
        for d, s in enumerate(row):
            k = positions(s)
            ids[i, at:at + k], lab[i, at:at + k] = torch.tensor(s.tokens[:-1]), torch.tensor(s.tokens[1:])
            mask[i, at:at + k], doc[i, at:at + k] = torch.tensor(s.loss_mask[1:], dtype=torch.float32), d
            for key, v in s.values.items():  # the value of token t + 1 sits where it is predicted
                extra[key][i, at:at + k] = torch.tensor(v[1:], dtype=torch.float32)
            for name, key in REPLAYED.items():  # token t's choices sit where it is read
                if name in extra:
                    extra[name][i, at:at + k] = torch.as_tensor(np.asarray(getattr(s, key))[:-1]).to(extra[name].dtype)
            at += k
    return MicroBatch(ids, lab, mask, None if bool((doc == 0).all()) else doc, **extra)


def replica_micro_batches(samples: list[Sample], dp: int, micro_batch_size: int,
                          pad_to_multiple: int = 1) -> list[list[MicroBatch]]:
    """A global batch split over `dp` data-parallel replicas (contiguous, equal counts), each
    share cut into micro-batches of `micro_batch_size` samples."""
    if len(samples) % (dp * micro_batch_size):
        raise ValueError(f"{len(samples)} samples do not split into {dp} replicas x micro-batches of "
                         f"{micro_batch_size}")
    per = len(samples) // dp
    return [[to_micro_batch([[s] for s in samples[r * per + i: r * per + i + micro_batch_size]], pad_to_multiple)
             for i in range(0, per, micro_batch_size)] for r in range(dp)]


def partition(samples: list[Sample], parts: int) -> list[list[Sample]]:
    """Split samples over `parts` data-parallel replicas: counts as equal as they can be
    (n // parts or one more), positions balanced (longest first, each to the replica with
    the fewest positions that still has room). Within a replica, input order is kept."""
    if len(samples) < parts:
        raise ValueError(f"{len(samples)} samples cannot be shared by {parts} data-parallel replicas")
    room = [len(samples) // parts + (r < len(samples) % parts) for r in range(parts)]
    load, owner = [0] * parts, [0] * len(samples)
    for i in sorted(range(len(samples)), key=lambda i: -positions(samples[i])):
        r = min((r for r in range(parts) if room[r]), key=lambda r: (load[r], r))
        owner[i], room[r], load[r] = r, room[r] - 1, load[r] + positions(samples[i])
    return [[s for s, o in zip(samples, owner, strict=True) if o == r] for r in range(parts)]


def split_rows(rows: list[list[Sample]], at_least: int) -> list[list[Sample]]:
    """Halve the fullest packed rows until there are `at_least` rows (or every row holds one
    sample): expert parallelism needs every replica to run the same number of micro-batches."""
    rows = [list(r) for r in rows]
    while len(rows) < at_least:
        i = max(range(len(rows)), key=lambda i: (len(rows[i]), -i))
        if len(rows[i]) < 2:
            break
        half = len(rows[i]) // 2
        rows[i:i + 1] = [rows[i][:half], rows[i][half:]]
    return rows


def packed_replica_micro_batches(samples: list[Sample], dp: int, rows_per_micro_batch: int, row_tokens: int,
                                 pad_to_multiple: int = 1, same_count: bool = False) -> list[list[MicroBatch]]:
    """A global batch of variable-length samples (SFT): partitioned over `dp` replicas
    balanced by positions, packed per replica into rows of at most `row_tokens` positions,
    `rows_per_micro_batch` rows per micro-batch. `same_count`: every replica gets the same
    number of micro-batches (rows are split where needed; expert parallelism needs it)."""
    rows = [pack(share, row_tokens) for share in partition(samples, dp)]
    if same_count:
        want = max(-(-len(r) // rows_per_micro_batch) for r in rows)
        rows = [split_rows(r, (want - 1) * rows_per_micro_batch + 1) for r in rows]
    return [[to_micro_batch(r[i:i + rows_per_micro_batch], pad_to_multiple)
             for i in range(0, len(r), rows_per_micro_batch)] for r in rows]
