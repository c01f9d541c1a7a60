"""The one pickle in a dist_checkpointing checkpoint, checked before torch reads it.

torch.distributed.checkpoint stores its `.metadata` file with pickle and reads it back with
a plain `pickle.load` (tensors and `common.pt` are read with `torch.load(weights_only=True)`).
A crafted `.metadata` could name any callable. `check(directory)` unpickles the file with
an allow-list (DCP's own metadata and planner types, torch.Size, dtypes, plain containers)
first and refuses anything else, naming the file and the global, so the real load only
ever sees files made of those types.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path

import torch

from miles.ckpt.store import CheckpointError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_EXACT = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
          ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
          ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _Refused(pickle.UnpicklingError):
    pass


class _AllowList(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _EXACT:
            return super().find_class(module, name)
        if module in _DCP_MODULES:  # their data types only (dataclasses, enums), no functions
            obj = super().find_class(module, name)
            if dataclasses.is_dataclass(obj) or isinstance(obj, enum.EnumMeta):
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"global '{module}.{name}' is not allowed")


def check(directory: str | Path) -> None:
    path = Path(directory) / ".metadata"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a complete dist_checkpointing checkpoint)") from None
    try:
        _AllowList(io.BytesIO(data)).load()
    except _Refused as e:
        raise CheckpointError(f"{path}: refused ({e}); a checkpoint's metadata holds only torch's checkpoint "
                              f"types") from None
    except Exception as e:  # truncated or corrupt
        raise CheckpointError(f"{path}: corrupt ({type(e).__name__}: {e})") from None
