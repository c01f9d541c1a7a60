"""Reading and writing checkpoints in DeepSeek's official Hugging Face layout.

Model-independent: the state_dict keys of our model are DeepSeek's own tensor names
(``embed.weight``, ``layers.0.attn.wq_a.weight``, ``layers.3.ffn.experts.2.w1.weight``, ...),
so nothing here maps names.

Layout on disk
--------------
* ``model-00001-of-0000N.safetensors`` ... shards (5-digit numbering, as Hugging Face does) and
  ``model.safetensors.index.json`` = ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``.
  A directory holding a single ``model.safetensors`` and no index is also read.
* Quantized weights come as a pair ``X.weight`` + ``X.scale``:

  - FP8 block weights: ``X.weight`` is ``float8_e4m3fn`` of shape ``[out, in]`` and ``X.scale``
    (``float8_e8m0fnu`` or a plain float dtype) has shape ``[ceil(out/b0), ceil(in/b1)]``; every
    ``b0 x b1`` block of the weight (cropped at the edges) is multiplied by its scale. The block size is
    ``quantization_config.weight_block_size`` of ``config.json`` when present, else ``[128, 128]``.
  - FP4 expert weights: ``X.weight`` is ``int8``/``uint8`` (or torch's ``float4_e2m1fn_x2``), its name
    contains ``.experts.``, its shape is ``[out, in/2]``, and ``X.scale`` has shape ``[out, ceil(in/32)]``.
    Each byte packs two e2m1 codes: the LOW nibble (bits 0-3) is logical element ``2j`` and the HIGH
    nibble (bits 4-7) is element ``2j+1`` (the OCP MX order). In a code, bit 3 is the sign and bits 0-2
    index the magnitudes ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``. Each group of 32 consecutive logical elements
    along the input dimension is multiplied by its scale.

  The loader returns the dequantized weight (float32, or ``dtype_for_float``) under ``X.weight`` and does
  not return ``X.scale``.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "FP32_NAMES_SUFFIXES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "dequantize_fp4",
    "dequantize_fp8_block",
    "load_safetensors_dir",
    "quantize_fp4_experts",
    "quantize_fp8_block",
    "save_safetensors_shards",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# Parameters that the model keeps in float32 whatever the compute dtype. A name matches when it equals one
# of these or ends with "." followed by one of these (i.e. the match is on whole dotted components).
FP32_NAMES_SUFFIXES: tuple[str, ...] = (
    "attn_sink",
    "ape",
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "gate.bias",
)

DEFAULT_FP8_BLOCK: tuple[int, int] = (128, 128)
FP4_GROUP = 32
FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
# Magnitudes of the e2m1 codes 0..7; code bit 3 is the sign.
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# e8m0 holds 2**(code - 127) for codes 0..254 (255 is NaN).
_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127

_FP4_PACKED_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.uint8) + (
    (torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ()
)


# ----------------------------------------------------------------------------------------------------------
# small helpers


def _is_fp32_name(name: str) -> bool:
    return any(name == s or name.endswith("." + s) for s in FP32_NAMES_SUFFIXES)


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


def _scale_name_for(weight_name: str) -> str | None:
    """``X.weight`` -> ``X.scale``; None for names that are not ``*.weight``."""
    if weight_name.endswith(".weight"):
        return weight_name[: -len(".weight")] + ".scale"
    return None


def _weight_name_for(scale_name: str) -> str:
    return scale_name[: -len(".scale")] + ".weight"


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Scale of shape [ceil(r/b0), ceil(c/b1)] -> float32 [r, c], each entry covering one (cropped) block."""
    r, c = shape
    s = scale.float()
    s = s.repeat_interleave(block[0], dim=0)[:r]
    return s.repeat_interleave(block[1], dim=1)[:, :c]


def _pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest integer e with amax <= qmax * 2**e (amax == 0 -> e = 0), clamped to the e8m0 range.

    Computed in float64 (exact for float32/bfloat16 inputs) and then checked exactly in both directions, so
    rounding in log2 can never produce a scale that overflows the target format.
    """
    a = amax.double()
    safe = torch.where(a > 0, a, torch.ones_like(a))
    e = torch.ceil(torch.log2(safe / qmax))
    # exact fix-up: dividing by a power of two is exact in float64 across this whole range
    e = torch.where(safe / torch.exp2(e) > qmax, e + 1, e)
    e = torch.where(safe / torch.exp2(e - 1) <= qmax, e - 1, e)
    e = torch.where(a > 0, e, torch.zeros_like(e))
    return e.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP).to(torch.int64)


def _e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """Integer exponents in [-127, 127] -> float8_e8m0fnu holding exactly 2**e (built from the raw code)."""
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _check_finite(w: torch.Tensor, what: str) -> None:
    if not torch.isfinite(w).all():
        raise ValueError(f"{what}: input contains NaN or Inf")


# ----------------------------------------------------------------------------------------------------------
# FP8 block quantization


def dequantize_fp8_block(
    w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | list[int] = DEFAULT_FP8_BLOCK
) -> torch.Tensor:
    """FP8 weight [out, in] and per-block scale [ceil(out/b0), ceil(in/b1)] -> float32 [out, in]."""
    b0, b1 = (int(block[0]), int(block[1]))
    if w.dim() != 2:
        raise ValueError(f"FP8 block weight must be 2-D, got shape {tuple(w.shape)}")
    out, inp = w.shape
    want = (math.ceil(out / b0), math.ceil(inp / b1))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not match weight shape {tuple(w.shape)} "
            f"with block {[b0, b1]} (expected {want})"
        )
    return w.float() * _expand_blocks(scale, (out, inp), (b0, b1))


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] | list[int] = DEFAULT_FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest FP8 block quantization, the inverse of :func:`dequantize_fp8_block`.

    Per ``b0 x b1`` block (cropped at the edges): scale = 2**ceil(log2(amax / 448)) as float8_e8m0fnu
    (1 for an all-zero block), weight = (w / scale).to(float8_e4m3fn).
    Returns ``(w_fp8 [out, in], scale [ceil(out/b0), ceil(in/b1)])``.
    """
    b0, b1 = (int(block[0]), int(block[1]))
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block expects a 2-D weight, got shape {tuple(w.shape)}")
    _check_finite(w, "quantize_fp8_block")
    out, inp = w.shape
    nb0, nb1 = math.ceil(out / b0), math.ceil(inp / b1)
    wf = w.detach().float()
    padded = torch.zeros(nb0 * b0, nb1 * b1, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = wf
    amax = padded.abs().reshape(nb0, b0, nb1, b1).amax(dim=(1, 3))
    e = _pow2_exponent(amax, FP8_E4M3_MAX)
    scale = _e8m0_from_exponent(e)
    q = (wf / _expand_blocks(scale, (out, inp), (b0, b1))).to(torch.float8_e4m3fn)
    return q, scale


# ----------------------------------------------------------------------------------------------------------
# FP4 (e2m1) expert quantization


def _unpack_e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """[out, p] bytes -> [out, 2p] codes (uint8 0..15); low nibble first."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1)
    return codes.reshape(*b.shape[:-1], b.shape[-1] * 2)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """Packed e2m1 weight [out, in/2] (int8/uint8; LOW nibble = element 2j, HIGH nibble = element 2j+1)
    and scale [out, ceil(in/group)] -> float32 [out, in]."""
    if packed.dtype not in _FP4_PACKED_DTYPES:
        raise ValueError(f"FP4 packed weight must be int8/uint8, got {packed.dtype}")
    if packed.dim() != 2:
        raise ValueError(f"FP4 packed weight must be 2-D, got shape {tuple(packed.shape)}")
    out, inp = packed.shape[0], packed.shape[1] * 2
    want = (out, math.ceil(inp / group))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"FP4 scale shape {tuple(scale.shape)} does not match packed weight shape {tuple(packed.shape)} "
            f"(logical [{out}, {inp}], group {group}; expected {want})"
        )
    codes = _unpack_e2m1_codes(packed).long()
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=packed.device)
    mag = table[codes & 0x7]
    values = torch.where((codes & 0x8) != 0, -mag, mag)
    s = scale.float().repeat_interleave(group, dim=1)[:, :inp]
    return values * s


def _round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 values with |x| <= 6 -> e2m1 codes (int64 0..15), round to nearest, ties to even code."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=x.device)
    mids = (table[1:] + table[:-1]) / 2
    a = x.abs().contiguous()
    lo = torch.bucketize(a, mids, right=False)  # ties -> lower code
    hi = torch.bucketize(a, mids, right=True)  # ties -> upper code
    idx = torch.where(lo == hi, lo, torch.where(lo % 2 == 0, lo, hi))
    idx = idx.clamp_max(len(E2M1_MAGNITUDES) - 1)
    neg = (x < 0) & (idx > 0)  # no negative zero
    return idx + neg.long() * 8


def quantize_fp4_experts(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest FP4 (e2m1) quantization, the inverse of :func:`dequantize_fp4`.

    Per group of ``group`` consecutive elements along the input dim: scale = 2**ceil(log2(amax / 6)) as
    float8_e8m0fnu (1 for an all-zero group), each value rounded to the nearest e2m1 code (ties to even).
    Returns ``(packed int8 [out, in/2], scale [out, ceil(in/group)])``; low nibble = element 2j.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp4_experts expects a 2-D weight, got shape {tuple(w.shape)}")
    out, inp = w.shape
    if inp % 2:
        raise ValueError(f"quantize_fp4_experts needs an even input dim, got shape {tuple(w.shape)}")
    _check_finite(w, "quantize_fp4_experts")
    ng = math.ceil(inp / group)
    wf = w.detach().float()
    padded = torch.zeros(out, ng * group, dtype=torch.float32, device=w.device)
    padded[:, :inp] = wf
    amax = padded.abs().reshape(out, ng, group).amax(dim=2)
    e = _pow2_exponent(amax, FP4_E2M1_MAX)
    scale = _e8m0_from_exponent(e)
    x = wf / scale.float().repeat_interleave(group, dim=1)[:, :inp]
    codes = _round_to_e2m1_codes(x).to(torch.uint8).reshape(out, inp // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.view(torch.int8), scale


# ----------------------------------------------------------------------------------------------------------
# writing


def _prepare_for_save(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, none sharing storage with another (safetensors refuses that)."""
    out: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name in sorted(state_dict):
        t = state_dict[name]
        if not isinstance(name, str):
            raise TypeError(f"state_dict key {name!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().cpu().contiguous()
        if t.numel() > 0:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            owns_whole = t.storage_offset() == 0 and storage.nbytes() == _tensor_nbytes(t)
            if ptr in seen_storages or not owns_whole:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen_storages.add(ptr)
        out[name] = t
    return out


def _file_mode() -> int:
    """The mode a new file gets here (0o666 less the umask, read without changing it):
    safetensors writes its files 0600, which other users of a shared checkpoint cannot read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


def _atomic_write(directory: Path, name: str, write) -> None:
    tmp = directory / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        os.chmod(tmp, _file_mode())  # as the directory's other files
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_safetensors_shards(
    state_dict: Mapping[str, torch.Tensor], directory: str | os.PathLike, max_shard_bytes: int = 2**30
) -> list[str]:
    """Write ``state_dict`` as ``model-XXXXX-of-YYYYY.safetensors`` shards and the index json.

    Tensors go in sorted name order, each with its own dtype, made contiguous; a shard is closed when the next
    tensor would push it past ``max_shard_bytes`` (a tensor larger than the limit gets a shard of its own).
    Tensors sharing storage are cloned so that every tensor is written once. Each file is written under a
    temporary name in ``directory`` and moved into place with ``os.replace``; the index is written last.
    ``total_size`` in the index is the sum of tensor bytes (as Hugging Face writes it). Shard files left
    from an earlier save with a different shard count are not removed (the index does not name them).
    Returns the shard file names (not paths), in order.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not state_dict:
        raise ValueError("save_safetensors_shards: state_dict is empty")
    tensors = _prepare_for_save(state_dict)

    groups: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, t in tensors.items():  # already sorted
        nb = _tensor_nbytes(t)
        if current and current_bytes + nb > max_shard_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nb
    groups.append(current)

    directory = Path(directory)
    n = len(groups)
    files: list[str] = []
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups, start=1):
        fname = _shard_name(i, n)
        _write_prepared(directory, fname, {k: tensors[k] for k in names})
        files.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    write_index(directory, weight_map, sum(_tensor_nbytes(t) for t in tensors.values()))
    return files


def write_shard(directory: str | os.PathLike, fname: str, tensors: Mapping[str, torch.Tensor]) -> int:
    """One safetensors file of `tensors` (made contiguous CPU tensors, shared storage cloned),
    written under a temporary name and moved into place. Returns its tensors' bytes."""
    return _write_prepared(directory, fname, _prepare_for_save(tensors))


def _write_prepared(directory: str | os.PathLike, fname: str, shard: Mapping[str, torch.Tensor]) -> int:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(directory, fname, lambda p: save_file(dict(shard), str(p), metadata={"format": "pt"}))
    return sum(_tensor_nbytes(t) for t in shard.values())


def write_index(directory: str | os.PathLike, weight_map: Mapping[str, str], total_size: int) -> None:
    """The shards' index json (written last: a directory without it is not a checkpoint)."""
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}

    def write(p: Path) -> None:
        p.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    _atomic_write(Path(directory), INDEX_FILE, write)


# ----------------------------------------------------------------------------------------------------------
# reading


def _read_json(path: Path) -> object:
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _read_block_size(directory: Path) -> tuple[int, int]:
    cfg_path = directory / CONFIG_FILE
    if not cfg_path.is_file():
        return DEFAULT_FP8_BLOCK
    cfg = _read_json(cfg_path)
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    block = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if block is None:
        return DEFAULT_FP8_BLOCK
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"{cfg_path}: quantization_config.weight_block_size must be two positive ints, got {block!r}"
        )
    return int(block[0]), int(block[1])


def _read_weight_map(directory: Path) -> dict[str, str]:
    """name -> file name (relative to directory)."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        index = _read_json(index_path)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise ValueError(f"{index_path}: no 'weight_map' object")
        for name, fname in wm.items():
            if not isinstance(fname, str) or not fname:
                raise ValueError(f"{index_path}: tensor {name!r} maps to {fname!r}, not a file name")
            if Path(fname).is_absolute() or ".." in Path(fname).parts:
                raise ValueError(f"{index_path}: tensor {name!r} maps to {fname!r}, outside the directory")
        return dict(wm)
    single = directory / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    raise FileNotFoundError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _plan_pairs(weight_map: Mapping[str, str]) -> dict[str, str]:
    """weight name -> scale name for every ``X.scale`` in the map; orphan scales raise ValueError."""
    pairs: dict[str, str] = {}
    for name in weight_map:
        if name.endswith(".scale"):
            wname = _weight_name_for(name)
            if wname not in weight_map:
                raise ValueError(f"scale tensor {name!r} (file {weight_map[name]}) has no weight {wname!r}")
            pairs[wname] = name
    return pairs


def _open_shard(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error type for corrupt headers
        raise ValueError(f"{path}: cannot open as safetensors ({e})") from e


def _unscaled_fp8(name: str, fname: str) -> ValueError:
    return ValueError(f"tensor {name!r} (file {fname}) is float8_e4m3fn but has no "
                      f"{_scale_name_for(name) or 'scale'!r} to dequantize it")


def _pair_files(weight_map: Mapping[str, str], wname: str, sname: str) -> str:
    w, s = weight_map[wname], weight_map[sname]
    return w if w == s else f"{w}, {s}"


def _dequantize_pair(
    wname: str, w: torch.Tensor, sname: str, s: torch.Tensor, files: str, block: tuple[int, int]
) -> torch.Tensor:
    where = f"tensor {wname!r} / {sname!r} (file {files})"
    if not _is_float(s):
        raise ValueError(f"{where}: scale has non-float dtype {s.dtype}")
    try:
        if w.dtype == torch.float8_e4m3fn:
            return dequantize_fp8_block(w, s, block)
        if w.dtype in _FP4_PACKED_DTYPES:
            if w.dtype in (torch.int8, torch.uint8) and ".experts." not in wname:
                raise ValueError(f"{w.dtype} weight with a scale is only read as FP4 for '.experts.' tensors")
            return dequantize_fp4(w, s, FP4_GROUP)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    raise ValueError(f"{where}: a scale is present but the weight dtype {w.dtype} is not a quantized format")


def _finalize(name: str, t: torch.Tensor, dtype_for_float: torch.dtype | None) -> torch.Tensor:
    if dtype_for_float is None or not _is_float(t):
        return t
    target = torch.float32 if _is_fp32_name(name) else dtype_for_float
    return t if t.dtype == target else t.to(target)


def load_safetensors_dir(
    directory: str | os.PathLike, dtype_for_float: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Load a Hugging Face safetensors checkpoint directory and dequantize FP8/FP4 weights.

    * Reads ``model.safetensors.index.json`` (the index is authoritative: tensors in a shard that the index
      does not name are ignored), or a lone ``model.safetensors``.
    * ``X.weight`` + ``X.scale`` pairs are dequantized to float32 (see the module docstring for the FP8 block
      and FP4 formats, FP4 packing: LOW nibble = element 2j, HIGH nibble = element 2j+1); the ``.scale``
      tensors are not returned. An ``X.scale`` without ``X.weight``, a scale that does not fit its weight,
      or an FP8 weight without a scale raises ValueError naming tensor and file.
    * Non-float tensors (int64 ``tid2eid``, ...) are returned unchanged. With ``dtype_for_float`` every float
      tensor is cast to it, except names matching ``FP32_NAMES_SUFFIXES``, which become float32; without it
      float tensors keep their stored dtype (dequantized weights are float32).
    * A missing shard raises FileNotFoundError, bad JSON or a tensor named in the index but absent from its
      file raises ValueError; the messages name the file and the tensor.
    """
    directory = Path(directory)
    weight_map = _read_weight_map(directory)
    block = _read_block_size(directory)
    pairs = _plan_pairs(weight_map)  # weight -> scale
    partner = {**pairs, **{s: w for w, s in pairs.items()}}

    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)

    result: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}  # one half of a weight/scale pair waiting for the other
    for fname in sorted(by_file):
        path = directory / fname
        names = sorted(by_file[fname])
        if not path.is_file():
            raise FileNotFoundError(
                f"shard {path} listed in {INDEX_FILE} is missing (it should hold {names[0]!r}"
                + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                + ")"
            )
        with _open_shard(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise ValueError(
                        f"tensor {name!r} is listed in {INDEX_FILE} for {fname} but not in that file"
                    )
                t = f.get_tensor(name)
                if name not in partner:
                    if t.dtype == torch.float8_e4m3fn:
                        raise _unscaled_fp8(name, fname)
                    result[name] = _finalize(name, t, dtype_for_float)
                    continue
                other = partner[name]
                if other not in pending:
                    pending[name] = t
                    continue
                o = pending.pop(other)
                wname, sname = (name, other) if name in pairs else (other, name)
                w, s = (t, o) if name in pairs else (o, t)
                result[wname] = _finalize(
                    wname,
                    _dequantize_pair(wname, w, sname, s, _pair_files(weight_map, wname, sname), block),
                    dtype_for_float,
                )
    if pending:  # cannot happen: every pair member is in the weight map and was loaded
        raise ValueError(f"unpaired tensors after loading: {sorted(pending)}")
    return result


def iter_tensors(directory: str | os.PathLike, names: list[str]):
    """Read only `names` from an HF checkpoint directory, one tensor at a time, dequantizing
    FP8/FP4 pairs: yields (name, tensor, bytes held to produce it). A sharded worker asks for
    the names it holds, so its peak is its shard plus one tensor (and its scale) in flight.
    A name the checkpoint lacks raises ValueError naming the directory and the tensor."""
    directory = Path(directory)
    weight_map = _read_weight_map(directory)
    block = _read_block_size(directory)
    pairs = _plan_pairs(weight_map)
    missing = [n for n in names if n not in weight_map]
    if missing:
        raise ValueError(f"{directory}: checkpoint does not match the config: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}")
    handles: dict[str, object] = {}

    def read(name: str) -> torch.Tensor:
        fname = weight_map[name]
        if fname not in handles:
            path = directory / fname
            if not path.is_file():
                raise FileNotFoundError(f"shard {path} listed in {INDEX_FILE} is missing (it should hold {name!r})")
            handles[fname] = _open_shard(path)
        try:
            return handles[fname].get_tensor(name)
        except Exception as e:
            raise ValueError(f"tensor {name!r} is listed in {INDEX_FILE} for {fname} but cannot be read ({e})") from e

    for name in names:
        t = read(name)
        if name in pairs:
            sname = pairs[name]
            s = read(sname)
            out = _dequantize_pair(name, t, sname, s, _pair_files(weight_map, name, sname), block)
            yield name, out, _tensor_nbytes(t) + _tensor_nbytes(s) + _tensor_nbytes(out)
        else:
            if t.dtype == torch.float8_e4m3fn:
                raise _unscaled_fp8(name, weight_map[name])
            yield name, t, _tensor_nbytes(t)
