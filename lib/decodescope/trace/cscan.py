"""The Kineto event scanner in C (_kscan.c): built once per source version with the machine's C compiler
into the user's cache, loaded with ctypes. Two uses: `kscan` reads a run of events into columns for the
numpy reduction (scan_chunk, below), and `kr_*` reduce a whole rank file into per-name sums
(creduce.py, the breakdown's fast path). Where it cannot be built (no compiler) or is turned off
(DECODESCOPE_NO_CSCAN=1), parse.py's numpy reader does the work, and so it does for any run of events
the scanner leaves (KSCAN_NOT_MINE: an escaped name, a string where a number belongs, a layout that is
not a run of objects).

Why C: the numpy reader makes some twenty passes over every byte (quotes, keys, fingerprints, number
columns) and reads ~55 MB/s of JSON a core on this project's 2-core machine; one sweep with a small
tokenizer reads ~1 GB/s, so a rank file is read faster than it decompresses.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, cast

from decodescope.core.resources import cache_dir
from decodescope.trace.reader import COMM_CPU_OP, KEPT_CATS, LAUNCH_RUNTIME, _json_string, name_rule

if TYPE_CHECKING:  # numpy where chunks are read into columns: creduce.py loads the library without it
    import numpy as np

    from decodescope.trace.columns import _Columns

SOURCE = Path(__file__).with_name("_kscan.c")
NOT_MINE, FULL = -1, -2
_CPU_OP, _RUNTIME, _DRIVER = KEPT_CATS.index("cpu_op"), KEPT_CATS.index("cuda_runtime"), KEPT_CATS.index("cuda_driver")
_UNSET = object()
_lib = _UNSET


def library() -> Optional[ctypes.CDLL]:
    """The scanner, built now if this source version has not been yet; None where it cannot be."""
    global _lib
    if _lib is not _UNSET:
        return cast(Optional[ctypes.CDLL], _lib)  # once set, _lib is the library or None
    _lib = None
    if os.environ.get("DECODESCOPE_NO_CSCAN"):
        return None
    try:
        src = SOURCE.read_bytes()
        tag = hashlib.sha256(src + sys.platform.encode() + os.uname().machine.encode()).hexdigest()[:16]
        so = cache_dir() / f"kscan-{tag}.so"
        if not so.exists():
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if not cc:
                return None
            so.parent.mkdir(parents=True, exist_ok=True)
            tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")  # several processes may build at once
            try:
                subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)], check=True,
                               capture_output=True, timeout=120)
                os.replace(tmp, so)
            finally:
                tmp.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError):
        return None
    p = ctypes.c_void_p
    lib.kscan.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p, p, p, p, p, p, p, p]
    lib.kscan.restype = ctypes.c_int64
    # the streamed reduction (creduce.py)
    lib.kr_new.argtypes, lib.kr_new.restype = [ctypes.c_int], p
    lib.kr_free.argtypes, lib.kr_free.restype = [p], None
    lib.kr_feed.argtypes, lib.kr_feed.restype = [p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64], ctypes.c_int64
    lib.kr_finish.argtypes, lib.kr_finish.restype = [p], ctypes.c_int64
    lib.kr_sizes.argtypes, lib.kr_sizes.restype = [p, p], None
    lib.kr_names.argtypes, lib.kr_names.restype = [p, p, p, p], None
    lib.kr_sums.argtypes, lib.kr_sums.restype = [p, p, p, p, p, p], None
    lib.kr_pairs.argtypes, lib.kr_pairs.restype = [p, p, p, p], None
    # the critical path's what-if replay (critpath/whatif.py)
    lib.cp_replay.argtypes, lib.cp_replay.restype = ([ctypes.c_int64] + [p] * 16 + [ctypes.c_double, p, p, ctypes.c_int64],
                                                      ctypes.c_double)
    # the critical path's pieces (critpath/pieces.py)
    lib.cp_cut.argtypes, lib.cp_cut.restype = [ctypes.c_int64] + [p] * 9, ctypes.c_int64
    lib.cp_segments.argtypes, lib.cp_segments.restype = [ctypes.c_int64] * 2 + [p] * 19, ctypes.c_int64
    lib.kr_ruled.argtypes, lib.kr_ruled.restype = [p, p, p], None
    _lib = lib
    return lib


class NameIndex:
    """Name hashes -> (name code, a communication op's name, a launching runtime call's name), one
    entry per distinct name of the file."""

    def __init__(self):
        self.by_hash: dict[int, tuple[int, bool, bool]] = {}

    def lookup(self, cols: _Columns, buf: bytes, hashes: np.ndarray, off: np.ndarray, length: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # lean: analyze-trace --breakdown loads this module without numpy or pandas (cli.py's start-up budget)
        import numpy as np

        uniq, first, inv = np.unique(hashes, return_index=True, return_inverse=True)
        code = np.empty(len(uniq), np.int32)
        comm = np.empty(len(uniq), bool)
        launch = np.empty(len(uniq), bool)
        by_hash = self.by_hash
        for i, (h, j) in enumerate(zip(uniq.tolist(), first.tolist())):
            entry = by_hash.get(h)
            if entry is None:
                o = int(off[j])
                raw = buf[o:o + int(length[j])]
                c = int(cols.code_raw("name", [raw])[0])
                text = _json_string(raw)
                entry = by_hash[h] = (c, bool(COMM_CPU_OP.search(text)), bool(LAUNCH_RUNTIME.search(text)))
            code[i], comm[i], launch[i] = entry
        return code[inv], comm[inv], launch[inv]


def scan_chunk(buf: bytes, lo: int, hi: int, is_gpu: bool, cols: _Columns, names: NameIndex) -> Optional[int]:
    """The kept events of buf[lo:hi] into cols (name, cat, ts, dur, tid; the other columns missing), by
    reader.name_rule (CPU ops on a GPU trace and runtime calls kept by name); returns the events
    seen, or None where the numpy reader must read it."""
    lib = library()
    if lib is None:
        return None
    # lean: analyze-trace --breakdown loads this module without numpy or pandas (cli.py's start-up budget)
    import numpy as np

    cap = (hi - lo) // 64 + 64
    while True:
        cat = np.empty(cap, np.int8)
        off = np.empty(cap, np.int64)
        length = np.empty(cap, np.int32)
        hashes = np.empty(cap, np.uint64)
        ts = np.empty(cap, np.float64)
        dur = np.empty(cap, np.float64)
        tid = np.empty(cap, np.int64)
        seen = np.zeros(1, np.int64)
        n = lib.kscan(buf, lo, hi, cap, cat.ctypes.data, off.ctypes.data, length.ctypes.data, hashes.ctypes.data,
                      ts.ctypes.data, dur.ctypes.data, tid.ctypes.data, seen.ctypes.data)
        if n != FULL:
            break
        cap = buf.count(b"{", lo, hi) + 1  # at most one kept event an opening brace
    if n == NOT_MINE:
        return None
    if not n:
        return int(seen[0])
    cat, off, length, hashes = cat[:n], off[:n], length[:n], hashes[:n]
    has_name = off >= 0
    code = np.full(n, -1, np.int32)
    comm = np.zeros(n, bool)
    launch = np.zeros(n, bool)
    if has_name.any():
        code[has_name], comm[has_name], launch[has_name] = names.lookup(cols, buf, hashes[has_name], off[has_name],
                                                                       length[has_name])
    keep = np.ones(n, bool)
    by_name = {COMM_CPU_OP: comm, LAUNCH_RUNTIME: launch}
    for ci in (_CPU_OP, _RUNTIME, _DRIVER):  # kept by name where the rule says so (reader.name_rule)
        pattern = name_rule(KEPT_CATS[ci], is_gpu)
        if pattern is not None:
            sel = cat == ci
            keep[sel] = by_name[pattern][sel]
    rows = np.flatnonzero(keep)
    if not len(rows):
        return int(seen[0])
    cat = cat[rows]
    present, first = np.unique(cat, return_index=True)
    cat_codes = np.full(len(KEPT_CATS), -1, np.int32)
    for ci in present[np.argsort(first)].tolist():  # interned in order of appearance, as the reader does
        cat_codes[ci] = cols.code("cat", KEPT_CATS[ci])
    cols.add({"name": code[rows], "cat": cat_codes[cat], "ts": ts[rows], "dur": dur[rows], "tid": tid[rows]},
             len(rows))
    return int(seen[0])


def available() -> bool:
    return library() is not None

