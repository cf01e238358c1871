"""Run directories, atomic writes, checkpoints and the disk-space check.

Layout of one run (``<out>/<name>/``)::

    report.md, report_*.png          rendered from the members' files by ``nnrand.report``
    member_000/config.json           resolved config (seeds, routing per op, flags, fingerprint)
               metrics.csv           one row per epoch
               checksums.csv         weight checksum per step of epoch 0 and at every epoch end
               predictions.npz       final test logits, labels, groups
               weights_epoch_XXX.pt  flat float32 parameters per epoch (--save-epoch-weights)
               checkpoint.pt         model, optimizer, position, RNG states (end of epoch, Ctrl-C)
               result.json           written last: its presence marks the member finished

Every file is written to a temporary name in the same directory, flushed, fsync-ed and moved into place
with ``os.replace``, so a crash leaves either the old file or the new one, never half of one.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

METRICS_COLUMNS = ("epoch", "step", "train_loss", "train_top1", "test_loss", "test_top1", "test_top5",
                   "epoch_time_s", "step_time_ms")
CHECKSUM_COLUMNS = ("step", "epoch", "checksum")


class DiskSpaceError(OSError):
    """Not enough free space in the output directory for the estimated outputs."""


class CheckpointError(RuntimeError):
    """A member's checkpoint.pt exists but cannot be loaded (truncated, corrupt, not a checkpoint)."""


def member_dir(out: str | os.PathLike, name: str, member: int) -> Path:
    return Path(out) / name / f"member_{member:03d}"


# --------------------------------------------------------------------------------------------------
# Atomic writes


def _temp_file(path: Path) -> tuple[int, str]:
    """An open, new temporary file beside ``path`` (``.<name>.<random>.tmp``), created with mode 0666 so the
    umask in force now applies, as with a plain ``open`` (mkstemp's 0600 would hide a run from the user's
    group on a shared machine)."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress():
            os.unlink(tmp)
        raise


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


def write_text(path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def write_csv(path, columns: Iterable[str], rows: Iterable[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow(row)
    write_text(path, buf.getvalue())


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def torch_save(path, obj) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_bytes(path, buf.getvalue())


def small_ints(a: np.ndarray) -> np.ndarray:
    """An integer array in the narrowest signed type that holds its values (labels and group ids of a
    study member travel between machines: int8 or int16 instead of int64)."""
    if a.size == 0:
        return a.astype(np.int8)
    lo, hi = int(a.min()), int(a.max())
    for t in (np.int8, np.int16, np.int32):
        if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max:
            return a.astype(t)
    return a.astype(np.int64)


def npz_save(path, *, compress: bool = False, **arrays) -> None:
    buf = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buf, **arrays)
    write_bytes(path, buf.getvalue())


# --------------------------------------------------------------------------------------------------
# Member state


# The files a member's run writes (the layout above), and the temporary names they pass through
MEMBER_FILES = ("config.json", "metrics.csv", "checksums.csv", "predictions.npz", "checkpoint.pt", "result.json")
_EPOCH_WEIGHTS = re.compile(r"weights_epoch_\d{3,}\.pt")
_TEMP = re.compile(r"\.(.+)\.[0-9a-z_]+\.tmp")


def _member_file(name: str) -> bool:
    return name in MEMBER_FILES or bool(_EPOCH_WEIGHTS.fullmatch(name))


def clear_member(directory: str | os.PathLike) -> list[str]:
    """Remove a member's files from an earlier run (``--no-resume``): those in MEMBER_FILES, every
    ``weights_epoch_XXX.pt`` and the temporary files of their atomic writes. Anything else in the directory
    (a user's notes, other tools' files) stays. Returns the names removed."""
    d = Path(directory)
    if not d.is_dir():
        return []
    gone = []
    for f in sorted(d.iterdir()):
        temp = _TEMP.fullmatch(f.name)
        if f.is_file() and (_member_file(f.name) or (temp is not None and _member_file(temp.group(1)))):
            f.unlink(missing_ok=True)
            gone.append(f.name)
    return gone


def is_finished(directory: str | os.PathLike) -> bool:
    return (Path(directory) / "result.json").exists()


def load_checkpoint(directory: str | os.PathLike) -> dict | None:
    """The member's checkpoint, or None. A checkpoint that does not load is an error, not a fresh start:
    silently restarting would mix two runs' files in one directory."""
    path = Path(directory) / "checkpoint.pt"
    if not path.exists():
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several types for a damaged file (RuntimeError, EOFError, pickle's)
        reason = " ".join(f"{type(e).__name__}: {e}".split())  # one line: torch's messages span several
        raise CheckpointError(f"{path} exists but cannot be loaded ({reason[:200]}); delete it to start that "
                              "member again, or rerun with --no-resume") from e
    if not isinstance(ckpt, dict) or not {"config", "model", "optimizer", "rng", "state"} <= ckpt.keys():
        raise CheckpointError(f"{path} loads but is not an nnrand checkpoint; delete it to start that member "
                              "again, or rerun with --no-resume")
    return ckpt


# --------------------------------------------------------------------------------------------------
# Disk space


def estimate_member_bytes(n_params: int, n_buffers: int, *, epochs: int, steps_first_epoch: int,
                          n_test: int, classes: int, save_epoch_weights: bool) -> int:
    """Upper estimate of one member's files: checkpoint (params, momentum, buffers) twice over while it
    is replaced, predictions, checksums, metrics, optional epoch weights, plus 1 MiB of slack."""
    state = 4 * (2 * n_params + n_buffers)
    checkpoint = 2 * (state + 64 * 1024)
    predictions = n_test * (4 * classes + 16)
    checksums = 48 * (steps_first_epoch + epochs + 1)
    weights = (4 * n_params + 4096) * epochs if save_epoch_weights else 0
    return checkpoint + predictions + checksums + weights + 2**20


def check_free_space(directory: str | os.PathLike, need_bytes: int) -> int:
    """Raise :class:`DiskSpaceError` unless ``directory`` (or its nearest existing parent) has room for
    ``need_bytes`` plus a 10% margin; return the free bytes."""
    probe = Path(directory).resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes * 1.1:
        raise DiskSpaceError(f"not enough space in {probe}: the run needs about {need_bytes / 2**20:.1f} MiB, "
                             f"{free / 2**20:.1f} MiB are free")
    return free
