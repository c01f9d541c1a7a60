"""Weight updates of a serving model: staged to the side, verified, swapped in whole.

An update is a set of DeepSeek-named tensors, arriving in buckets (from the Ray object
store, a torch.distributed broadcast, a directory or an HTTP body). Each bucket is checked
on arrival (name known, shape equal, MD5 of the received bytes equal to the sender's),
converted to the model's dtype and device and kept in a staging area. `commit` checks that
every announced name arrived and copies all of them into the model between two decoding
steps. Any failure drops the staging area: the model keeps serving its old weights, and the
error goes back to whoever drove the update. Staging holds one extra copy of the updated
tensors (an engine's weights are small next to its trainer's state).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from plugins.deepseek_v4.checksum import tensor_md5


class WeightSyncError(RuntimeError):
    """A weight update that was refused; the model still holds its previous weights."""


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: tensor_md5(v) for k, v in tensors.items()}


def bucket_digests(flat: torch.Tensor, spec: list[tuple[str, list[int], str]]) -> dict[str, str | int]:
    """What the two ends of a sync compare for each tensor of a bucket, from its flat buffer: on
    a GPU their fingerprints, computed there in one set of passes over the buffer (an MD5
    would copy every byte to the host and hash it at ~0.5 GB/s), on the host their MD5s."""
    from plugins.deepseek_v4.checksum import packed_fingerprints

    return packed_fingerprints(flat, spans_of(spec)) if flat.is_cuda else checksums(views_of(flat, spec))


def update_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an update may set: the model's state_dict entries, by name."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def cut_names(sizes: Iterable[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Names (with their bytes) in order, in buckets of at least `bucket_bytes` (the last may hold less)."""
    out, cur, size = [], [], 0
    for name, n in sizes:
        cur.append(name)
        size += n
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def cut(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """`tensors` in buckets of at least `bucket_bytes` (cut_names' cut)."""
    for names in cut_names(((n, t.numel() * t.element_size()) for n, t in tensors.items()), bucket_bytes):
        yield {n: tensors[n] for n in names}


def put_buckets(buckets: Iterable[dict[str, torch.Tensor]]) -> list[tuple]:
    """The object-store path's buckets, put one at a time: [(ObjectRef of {name: host copy},
    {name: MD5})]. A copy even on the host: Ray pickles tensors through numpy, which would pin
    the storages (a sleeping trainer could no longer free them)."""
    import ray

    out = []
    for b in buckets:
        host = {k: v.detach().to("cpu", copy=True) for k, v in b.items()}
        out.append((ray.put(host), checksums(host)))
    return out


class Staging:
    """One update in progress against `model` (its state_dict names and shapes)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.targets = update_targets(model)
        self.staged: dict[str, torch.Tensor] = {}
        self.bytes = 0

    def add(self, tensors: dict[str, torch.Tensor], sums: dict[str, str] | None) -> None:
        """Check and copy in a bucket: `sums` the sender's MD5s of the received bytes (None: the
        caller has compared them)."""
        for name, t in tensors.items():
            target = self.targets.get(name)
            if target is None:
                raise WeightSyncError(f"update holds '{name}', which the model does not have")
            if tuple(t.shape) != tuple(target.shape):
                raise WeightSyncError(f"'{name}': update has shape {list(t.shape)}, the model {list(target.shape)}")
            if sums is not None:
                if name not in sums:
                    raise WeightSyncError(f"'{name}': no checksum came with the tensor")
                got = tensor_md5(t)
                if got != sums[name]:
                    raise WeightSyncError(f"'{name}': checksum mismatch (sent {sums[name]}, received {got})")
            if name in self.staged:
                raise WeightSyncError(f"'{name}' arrived twice in one update")
            self.staged[name] = t.detach().to(device=target.device, dtype=target.dtype, copy=True)
            self.bytes += t.numel() * t.element_size()

    def add_bucket(self, flat: torch.Tensor, spec: list[tuple[str, list[int], str]],
                   fingerprints: dict[str, int] | None, own: bool = False) -> None:
        """Check and keep a bucket given as its flat buffer (bucket_buffer's layout): against the
        sender's `fingerprints` (checksum.packed_fingerprints, over the whole buffer at once) if
        given, else the caller has compared digests. Kept as views into one copy of the buffer
        (`own`: the buffer is this update's already, no copy) where the model's tensor has the
        same dtype and device, else converted one by one."""
        self.check_spec(spec)
        if fingerprints is not None:
            from plugins.deepseek_v4.checksum import packed_fingerprints

            got = packed_fingerprints(flat, spans_of(spec))
            for name, _, _ in spec:
                if name not in fingerprints:
                    raise WeightSyncError(f"'{name}': no fingerprint came with the tensor")
                if got[name] != fingerprints[name]:
                    raise WeightSyncError(f"'{name}': fingerprint mismatch (the received view is not the sent tensor)")
        views = views_of(flat if own else flat.clone(), spec)
        twice = sorted(set(views) & set(self.staged))
        if twice:
            raise WeightSyncError(f"'{twice[0]}' arrived twice in one update")
        for name, t in views.items():
            target = self.targets[name]
            same = t.dtype == target.dtype and t.device == target.device
            self.staged[name] = t if same else t.to(device=target.device, dtype=target.dtype)
            self.bytes += t.numel() * t.element_size()

    def check_spec(self, spec: list[tuple[str, list[int], str]]) -> None:
        """Names and shapes of an announced update, before any byte arrives."""
        for name, shape, dt in spec:
            target = self.targets.get(name)
            if target is None:
                raise WeightSyncError(f"update announces '{name}', which the model does not have")
            if tuple(shape) != tuple(target.shape):
                raise WeightSyncError(f"'{name}': update announces shape {list(shape)}, the model has "
                                      f"{list(target.shape)}")
            if not isinstance(getattr(torch, dt, None), torch.dtype):
                raise WeightSyncError(f"'{name}': unknown dtype {dt!r}")

    def commit(self, names: list[str]) -> int:
        """Copy the staged tensors into the model once `names` (all announced) have arrived."""
        missing = sorted(set(names) - set(self.staged))
        extra = sorted(set(self.staged) - set(names))
        if missing or extra:
            raise WeightSyncError(f"update incomplete: missing {missing[:5]}{'...' if len(missing) > 5 else ''}"
                                  f", not announced {extra[:5]}")
        groups: dict[tuple, tuple[list, list]] = {}  # multi-tensor copies take one device and dtype a call
        for name, t in self.staged.items():
            dst, src = groups.setdefault((t.device, t.dtype), ([], []))
            dst.append(self.targets[name])
            src.append(t)
        with torch.no_grad():  # a launch or a few a group, not one copy a tensor
            for dst, src in groups.values():
                torch._foreach_copy_(dst, src)
        return len(self.staged)


# --------------------------------------------------------------------------- HTTP bodies
def encode_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """A bucket as base64 safetensors bytes (the body of POST /update_weights_from_tensor;
    safetensors, not pickle: an engine never unpickles what it is sent)."""
    return base64.b64encode(safetensors_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
                            ).decode()


def decode_tensors(blob: str) -> dict[str, torch.Tensor]:
    try:
        return safetensors_load(base64.b64decode(blob, validate=True))
    except Exception as e:
        raise WeightSyncError(f"serialized_named_tensors: not base64 safetensors bytes ({e})") from e


# --------------------------------------------------------------------------- broadcast group
def listening_store(host: str, timeout_s: float = 300) -> dist.TCPStore:
    """A group's rendezvous store, already listening at `host` on a port the OS picked: its
    address can be published with nothing able to take the port first. (A port found free,
    closed and bound later by rank 0 was taken in between in a suite run: EADDRINUSE.)"""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def group_store(host: str, port: int, rank: int, size: int, timeout_s: float = 300,
                listening: dist.TCPStore | None = None) -> dist.TCPStore:
    """The store a rank of a group meets the others through: rank 0's `listening` store (from
    listening_store) when it is the one at host:port, else a client of host:port (rank 0
    without one listens there itself)."""
    if rank == 0 and listening is not None and listening.port == port:
        listening.set_timeout(timedelta(seconds=timeout_s))
        return listening
    return dist.TCPStore(host, port, size, is_master=rank == 0, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def open_group(host: str, port: int, rank: int, size: int, backend: str, timeout_s: float = 300,
               listening: dist.TCPStore | None = None):
    """A process group of its own between the trainer's sending ranks and the engines (not
    the default group: trainers and engines live in different worlds). gloo on CPU, nccl on GPU.
    `listening`: rank 0's store (group_store)."""
    store = group_store(host, port, rank, size, timeout_s, listening)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))


ALIGN = 16  # bytes: every tensor of a flat bucket starts aligned for any dtype's view
# each dtype by every name torch gives it ("float32", "float", ...): what check_spec accepts
_ITEMSIZE = {name: d.itemsize for name, d in vars(torch).items() if isinstance(d, torch.dtype)}


def _layout(spec: list[tuple[str, list[int], str]]) -> tuple[list[int], list[int], int]:
    """(each tensor's byte offset, its bytes, the buffer's bytes) of a bucket [(name, shape,
    dtype)]. Plain arithmetic: a sync walks ~1,000 tensors a bucket list at a 1B model."""
    offsets, sizes, off = [], [], 0
    for name, shape, dt in spec:
        if dt not in _ITEMSIZE:
            raise WeightSyncError(f"'{name}': unknown dtype {dt!r}")
        n = math.prod(shape) * _ITEMSIZE[dt]
        offsets.append(off)
        sizes.append(n)
        off += -(-n // ALIGN) * ALIGN
    return offsets, sizes, off


def bucket_buffer(spec: list[tuple[str, list[int], str]], device=None) -> tuple[torch.Tensor, dict]:
    """One flat byte buffer for a bucket [(name, shape, dtype)] and the tensor views into it;
    zeros between the tensors (fingerprints read an odd-sized tensor's next byte)."""
    flat = torch.zeros(_layout(spec)[2], dtype=torch.uint8, device=device)
    return flat, views_of(flat, spec)


def spans_of(spec: list[tuple[str, list[int], str]]) -> list[tuple[str, int, int]]:
    """A bucket's tensors as [(name, byte offset, bytes)] in its flat buffer."""
    offsets, sizes, _ = _layout(spec)
    return [(name, off, n) for (name, _, _), off, n in zip(spec, offsets, sizes, strict=True)]


def views_of(flat: torch.Tensor, spec: list[tuple[str, list[int], str]]) -> dict[str, torch.Tensor]:
    """The tensors of a bucket [(name, shape, dtype)] as views into its flat byte buffer."""
    offsets, sizes, total = _layout(spec)
    if flat.numel() < total:
        raise WeightSyncError(f"a bucket of {len(spec)} tensors needs {total} bytes, its buffer has {flat.numel()}")
    typed: dict[str, torch.Tensor] = {}  # the buffer viewed as each dtype once (offsets are ALIGN-aligned)
    views = {}
    for (name, shape, dt), off, n in zip(spec, offsets, sizes, strict=True):
        if dt not in typed:
            typed[dt] = flat[:total].view(getattr(torch, dt))
        size = _ITEMSIZE[dt]
        views[name] = typed[dt][off // size: (off + n) // size].view(shape)
    return views


# --------------------------------------------------------------------------- shared buffers (colocated)
def share(flat: torch.Tensor) -> tuple:
    """A handle another process on this machine opens (`opened`) as this very buffer: a CUDA
    IPC handle for a GPU buffer (no copy), a shared-memory file for a host one (the buffer moves
    there). Plain data (bytes, ints): Ray carries it as it is. The buffer must outlive every
    opening (the sender keeps it until the receivers are done)."""
    from torch.multiprocessing import reductions

    if flat.is_cuda:
        return reductions.reduce_tensor(flat)
    torch.multiprocessing.set_sharing_strategy("file_system")  # a name, not a descriptor: any process opens it
    flat.share_memory_()
    return reductions.reduce_storage(flat.untyped_storage())


def opened(handle: tuple) -> torch.Tensor:
    """The flat byte buffer another process shared (`share`), in place."""
    fn, args = handle
    obj = fn(*args)
    return obj if isinstance(obj, torch.Tensor) else torch.empty(0, dtype=torch.uint8).set_(obj)


def pack(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A bucket's tensors in one flat byte buffer laid out as `bucket_buffer(spec_of(...))`."""
    device = next(iter(tensors.values())).device
    flat, views = bucket_buffer(spec_of(tensors), device)
    torch._foreach_copy_(list(views.values()), list(tensors.values()))  # a few launches, not one a tensor
    return flat


def spec_of(tensors: dict[str, torch.Tensor]) -> list[tuple[str, list[int], str]]:
    return [(k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()]


def read_dir(path: str) -> dict[str, torch.Tensor]:
    from plugins.deepseek_v4.hf_io import load_safetensors_dir

    try:
        return load_safetensors_dir(path)
    except (OSError, ValueError) as e:
        raise WeightSyncError(f"{path}: {e}") from e

