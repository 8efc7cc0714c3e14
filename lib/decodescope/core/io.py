"""Atomic writes: a crash or Ctrl-C leaves either the old file or the new one, never half of one."""
from __future__ import annotations

import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any


# a file's name while _atomic_target's writer fills it: its final name and mkstemp's letters between these;
# copies between hosts leave such files out (ATOMIC_TMP_GLOB)
_ATOMIC_TMP_PREFIX, _ATOMIC_TMP_SUFFIX = ".", ".tmp"
ATOMIC_TMP_GLOB = f"{_ATOMIC_TMP_PREFIX}*{_ATOMIC_TMP_SUFFIX}"


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _atomic_target(path: Path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{_ATOMIC_TMP_PREFIX}{path.name}.",
                                suffix=_ATOMIC_TMP_SUFFIX)
    os.fchmod(fd, _umask_mode())  # mkstemp makes 0600; results are meant to be shared
    os.close(fd)
    return path, Path(tmp)


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    path, tmp = _atomic_target(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json_atomic(path: Path, obj: Any) -> Path:
    return write_bytes_atomic(path, (json.dumps(obj, indent=2, default=str) + "\n").encode())


def write_text_atomic(path: Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode())


def write_parquet_atomic(path: Path, df) -> Path:
    """A pandas DataFrame as parquet (pandas is the caller's: the probes import this module without it)."""
    path, tmp = _atomic_target(path)
    try:
        df.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def gzip_complete(path: Path) -> bool:
    """True when the file is a whole gzip stream (decompresses to its end with a valid trailer)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                d.decompress(chunk, 0)
                if d.eof:
                    return True
    except (OSError, zlib.error):
        return False
    return d.eof
