"""The checkpoint directory: how a save becomes visible, what counts as complete, what is reaped.

    <save_dir>/
        iter_0000050/                       complete: renamed into place after everything was written
            miles.json                      our metadata (iteration, data position, layout, model config)
            <Megatron dist_checkpointing files>
        .tmp-iter_0000100/                  a save in progress (or left by a crash: removed at the next start)
        latest_checkpointed_iteration.txt   written last

A save is written into `.tmp-iter_N`, fsynced, renamed to `iter_N` (atomic on one filesystem),
then the tracker is replaced atomically. A crash at any instant leaves every earlier
`iter_*` complete; the newest complete one is what a resume loads, so a crash between the
rename and the tracker loses nothing either (the tracker is repaired at the next start).
Deleting renames first, so a half-deleted checkpoint is never mistaken for a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from miles.ckpt.policy import iter_name, parse_iter_name, to_delete

TRACKER = "latest_checkpointed_iteration.txt"
META = "miles.json"
TMP = ".tmp-"
FORMAT = 1  # bumped when the layout of a checkpoint changes


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the job; names the path."""


def tmp_dir(save_dir: Path, iteration: int) -> Path:
    return Path(save_dir) / f"{TMP}{iter_name(iteration)}"


def begin(save_dir: Path, iteration: int) -> Path:
    """A fresh, empty directory to write iteration's checkpoint into."""
    tmp = tmp_dir(save_dir, iteration)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath))


def write_json(path: Path, obj) -> None:
    """Write, fsync and atomically replace `path`."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(save_dir: Path, iteration: int, meta: dict) -> Path:
    """Make the written `.tmp-iter_N` the checkpoint iter_N: metadata, fsync, rename, tracker."""
    save_dir = Path(save_dir)
    tmp, final = tmp_dir(save_dir, iteration), save_dir / iter_name(iteration)
    (tmp / META).write_text(json.dumps({"format": FORMAT, "iteration": iteration, **meta}, indent=1))
    _fsync_tree(tmp)
    if final.exists():  # the same iteration saved again (a run resumed from an older checkpoint)
        remove(final)
    os.rename(tmp, final)
    _fsync(save_dir)
    write_tracker(save_dir, iteration)
    return final


def write_tracker(save_dir: Path, iteration: int) -> None:
    tmp = Path(save_dir) / (TRACKER + ".tmp")
    with tmp.open("w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(save_dir) / TRACKER)
    _fsync(Path(save_dir))


def remove(path: Path) -> None:
    """Delete a checkpoint: rename it out of the iter_* namespace first, then delete."""
    doomed = path.with_name(f"{TMP}deleting-{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def iterations(save_dir: Path) -> list[int]:
    """Complete checkpoints in save_dir (renamed into place, metadata present), ascending."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = []
    for p in save_dir.iterdir():
        i = parse_iter_name(p.name)
        if i is not None and (p / META).is_file():
            found.append(i)
    return sorted(found)


def recover(save_dir: Path, report: Callable[[str], None]) -> None:
    """At a run's start: remove what crashed saves left (`.tmp-*`), and point the tracker at
    the newest complete checkpoint when a crash came between the rename and the tracker."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return
    for p in sorted(save_dir.glob(f"{TMP}*")):
        report(f"checkpoint: removing {p}, left by a save that did not finish")
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    its = iterations(save_dir)
    tracker = save_dir / TRACKER
    have = tracker.read_text().strip() if tracker.is_file() else None
    if its and have != str(its[-1]):
        report(f"checkpoint: {tracker} said {have}, the newest complete checkpoint is {iter_name(its[-1])}; "
               "tracker updated")
        write_tracker(save_dir, its[-1])


def resolve(load: str | None, save_dir: Path) -> Path | None:
    """ckpt.load -> the checkpoint directory to load, or None (auto with nothing saved yet).
    `load` is auto (save_dir's newest), a save_dir (its newest) or one iter_* directory."""
    if load is None:
        return None
    root = Path(save_dir) if load == "auto" else Path(load)
    if parse_iter_name(root.name) is not None:
        if not (root / META).is_file():
            raise CheckpointError(f"{root}: not a complete checkpoint (no {META}; a save that did not finish?)")
        return root
    its = iterations(root)
    if not its:
        if load == "auto":
            return None
        raise CheckpointError(f"{root}: no complete checkpoint (iter_NNNNNNN/ with {META}) in it")
    return root / iter_name(its[-1])


def read_meta(ckpt: Path) -> dict:
    path = Path(ckpt) / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a complete checkpoint)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("iteration"), int):
        raise CheckpointError(f"{path}: not a miles checkpoint of format {FORMAT} "
                              f"(format {meta.get('format') if isinstance(meta, dict) else None})")
    return meta


def reap(save_dir: Path, save_interval: int, keep_every: int | None, keep_last: int | None,
         report: Callable[[str], None]) -> list[int]:
    """Delete the checkpoints the retention policy does not keep (warm-up saves: those whose
    metadata says so, and iteration 1); returns their iterations."""
    its = iterations(save_dir)
    warmups = [i for i in its if _is_warmup_save(Path(save_dir) / iter_name(i))]
    gone = to_delete(its, save_interval, keep_every, keep_last, warmups)
    for i in gone:
        remove(Path(save_dir) / iter_name(i))
    if gone:
        report(f"checkpoint: removed {', '.join(iter_name(i) for i in gone)} (ckpt.keep_every / keep_last)")
    return gone


def _is_warmup_save(ckpt: Path) -> bool:
    try:
        return bool(json.loads((ckpt / META).read_text()).get("warmup"))
    except (OSError, ValueError):
        return False


def check_model(meta: dict, arch: dict, ckpt: Path) -> None:
    """The checkpoint's model must be the job's: every architecture field equal (the kernel
    switches aside: they do not change the weights)."""
    from miles.config import model_difference

    saved = meta.get("model", {})
    found = model_difference(saved, arch)
    if found:
        k, more = found
        raise CheckpointError(f"{Path(ckpt) / META}: model.{k} is {saved.get(k)!r} in the checkpoint but "
                              f"{arch.get(k)!r} in the job{more}")
