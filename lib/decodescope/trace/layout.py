"""Kineto's layout read with numpy (decodescope.trace.parse says how): a chunk of whole events into the
kept columns, or `_NotLayout` where the chunk must be decoded instead."""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from decodescope.trace.columns import ARG_INT, ARG_STR, _as_float, _as_int, _Columns, _loads
from decodescope.trace.reader import KEPT_CATS, _json_string, name_rule


# ---- the Kineto layout, read with numpy ------------------------------------------------------------
NUM_WINDOW = 21  # bytes read for a number: 18 digits, a sign, a dot and what ends it
_DELIMS = np.zeros(256, bool)
_DELIMS[list(b",\n\r\t }]")] = True
_POW10 = 10.0 ** np.arange(19)
_TWO53 = 1 << 53
# the kept categories, in a fixed order: the layout reader's category ids
_CPU_OP, _RUNTIME, _DRIVER = 5, 6, 7
# the keys read: top level (before "args") and inside args
TOP_KEYS = ("ph", "cat", "name", "pid", "tid", "ts", "dur", "args")
ARG_KEYS = tuple(ARG_INT.values()) + tuple(ARG_STR.values())
_KEYS = TOP_KEYS + ARG_KEYS
_KEY_ID = {k: i for i, k in enumerate(_KEYS)}


_TAIL_BYTES = 7  # a key's last bytes a fingerprint holds; longer keys are then compared whole
_TAIL_MASK = np.array([~((1 << (8 * (8 - min(n, _TAIL_BYTES)))) - 1) & ((1 << 64) - 1) for n in range(256)],
                      dtype=np.uint64)


def _fingerprint(A: np.ndarray, end: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Of each string ending before `end` (its closing quote) and `length` bytes long: its last seven
    bytes and its length, as one uint64 (the whole string up to seven bytes)."""
    tail = sliding_window_view(A, 8)[np.maximum(end - 8, 0)].view(np.uint64).ravel()
    n = np.minimum(length, 255).astype(np.uint64)
    return (tail & _TAIL_MASK[n]) | n


def _fingerprints(words) -> np.ndarray:
    text = b"".join(b" " * 8 + b'"' + w.encode() + b'"' for w in words)
    ends = np.cumsum([10 + len(w) for w in words]) - 1
    return _fingerprint(np.frombuffer(text, np.uint8), ends, np.array([len(w) for w in words]))


_KEY_FP = _fingerprints(_KEYS)
assert len(set(_KEY_FP.tolist())) == len(_KEYS), "two keys read share a fingerprint"
_FP_ORDER = np.argsort(_KEY_FP).astype(np.int8)
_FP_SORTED = _KEY_FP[_FP_ORDER]


_CAT_FP = _fingerprints(KEPT_CATS)
_CAT_FP_ORDER = np.argsort(_CAT_FP).astype(np.int8)
_CAT_FP_SORTED = _CAT_FP[_CAT_FP_ORDER]


class _NotLayout(Exception):
    """This chunk is not one the layout reader can take whole: decode it instead."""


def _parse_numbers(A: np.ndarray, starts: np.ndarray, width: int = NUM_WINDOW
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The JSON numbers starting at `starts`: (mantissa as int64, digits after the dot, negative, ok).
    ok is False where the text is not a plain decimal of at most 18 digits ending inside `width` bytes
    (an exponent, a string, null, a longer number): the caller reads those another way. One byte
    column of all the numbers at a time, until every number has ended."""
    n = len(starts)
    neg = A[starts] == 45
    at = starts + neg  # past the sign; moved one byte a column
    num = np.zeros(n, np.int64)
    dot_at = np.full(n, -1, np.int64)  # column of the dot
    dots = np.zeros(n, np.int8)
    end_at = np.zeros(n, np.int64)  # column of the byte that ends the number
    end_byte = np.zeros(n, np.uint8)
    alive = np.ones(n, bool)
    step, tmp, digit, dot, end = np.empty(n, bool), np.empty(n, np.int64), np.empty(n, bool), \
        np.empty(n, bool), np.empty(n, bool)
    for c in range(width - 1):
        col = A[at]
        d = col - np.uint8(48)
        np.less_equal(d, np.uint8(9), out=digit)
        np.logical_and(alive, digit, out=step)
        np.multiply(num, 10, out=tmp)
        tmp += d
        np.putmask(num, step, tmp)
        np.equal(col, 46, out=dot)
        np.logical_or(digit, dot, out=end)
        dot &= alive
        np.putmask(dot_at, dot, c)
        dots += dot
        np.logical_not(end, out=end)
        end &= alive
        np.putmask(end_at, end, c)
        np.putmask(end_byte, end, col)
        alive &= ~end
        if not alive.any():
            break
        at += 1
    frac = np.where(dot_at >= 0, end_at - dot_at - 1, 0)
    ndig = end_at - (dot_at >= 0)
    ok = (~alive & _DELIMS[end_byte] & (dots <= 1) & (ndig > 0) & (ndig <= 18) & (dot_at != 0)
          & ((dot_at < 0) | (frac > 0)))
    return num, frac, neg, ok


def _token(buf: bytes, start: int):
    """The JSON value at start (a number, string, literal) decoded one at a time: the rare values
    the vectorised reading leaves."""
    m = _TOKEN.match(buf, start)
    try:
        return _loads(m.group(0)) if m else None
    except ValueError:
        return None


_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[^,\s}\]]+')


class _Keys(NamedTuple):
    """A chunk's keys: where each quote is (Q), each kept key's closing quote (K), its id in _KEYS (kid),
    its index among the quotes (kqh), the event it belongs to (ev) and where its value starts (V)."""
    Q: np.ndarray
    K: np.ndarray
    kid: np.ndarray
    kqh: np.ndarray
    ev: np.ndarray
    V: np.ndarray
    n_ev: int


def _layout_chunk(buf: bytes, lo: int, hi: int, is_gpu: bool, cols: _Columns, name_ok: dict) -> int:
    """The events in buf[lo:hi] (a run of whole Kineto events) read into cols; returns the number of
    events seen. Raises _NotLayout where the chunk must be decoded instead (nothing added then)."""
    if buf.find(b"\\", lo, hi) >= 0 and buf.find(b'\\"', lo, hi) >= 0:
        raise _NotLayout  # an escaped quote: quotes no longer delimit strings alone
    A = np.frombuffer(buf, np.uint8)
    keys = _event_keys(A, lo, hi)
    if keys is None:
        return 0
    rows = _first_key_of_each_event(keys)
    cat = _kept_categories(A, keys, rows)
    cand = np.flatnonzero(cat >= 0)
    if not len(cand):
        return keys.n_ev
    cand, has_name, texts = _kept_by_name(buf, A, keys, rows, cat, cand, is_gpu, name_ok)
    if len(cand):
        _add_events(buf, A, keys, rows, cat, cand, has_name, texts, cols)
    return keys.n_ev


def _event_keys(A: np.ndarray, lo: int, hi: int) -> Optional[_Keys]:
    """Every event start and every kept key of A[lo:hi], each key placed in its event; None when the
    chunk holds no event."""
    R = A[lo:hi]
    Q = np.flatnonzero(R == 34) + lo  # every quote
    B = np.flatnonzero(R == 123) + lo  # every "{"
    E = B[(A[B - 1] == 32) & (A[B - 2] == 32) & (A[B - 3] == 10)]  # events: "\n  {"
    del B, R  # (temporaries are let go as soon as they are used: memory is a few chunks' worth)
    n_ev = len(E)
    if not n_ev:
        return None
    kq = np.flatnonzero(A[Q + 1] == 58)  # quotes closing a key: followed by ':'
    if not len(kq) or kq[0] == 0:
        raise _NotLayout
    K = Q[kq]
    Kopen = Q[kq - 1]
    fp = _fingerprint(A, K, K - Kopen - 1)
    pos = np.searchsorted(_FP_SORTED, fp)
    np.minimum(pos, len(_FP_SORTED) - 1, out=pos)
    hit = np.flatnonzero(_FP_SORTED[pos] == fp)
    kid = _FP_ORDER[pos[hit]]
    K, Kopen, kqh = K[hit], Kopen[hit], kq[hit]
    del kq, fp, pos, hit
    # the fingerprint decides keys of up to seven bytes; longer ones are compared whole
    for i in np.unique(kid):
        key = _KEYS[i].encode()
        if len(key) <= _TAIL_BYTES:
            continue
        sel = np.flatnonzero(kid == i)
        same = (sliding_window_view(A, len(key))[Kopen[sel] + 1] == np.frombuffer(key, np.uint8)).all(1)
        kid[sel[~same]] = -1
    keep = kid >= 0
    K, kid, kqh = K[keep], kid[keep], kqh[keep]
    del keep, Kopen
    if (A[K + 2] != 32).any():  # '"key": value' with its one space, as Kineto writes it
        raise _NotLayout
    # the event each key belongs to: the last event start before it
    ev = np.cumsum(np.bincount(np.searchsorted(K, E), minlength=len(K) + 1)[:len(K)]) - 1
    if (ev < 0).any():
        raise _NotLayout
    return _Keys(Q, K, kid, kqh, ev, K + 3, n_ev)  # a value starts after '": '


def _first_key_of_each_event(keys: _Keys) -> dict[str, np.ndarray]:
    """key name -> the rows of keys that are each event's first of that key, where it belongs: "args"
    splits an event, keys before it are the event's own, keys after it are its args."""
    K, kid, ev, n_ev = keys.K, keys.kid, keys.ev, keys.n_ev
    is_args = kid == _KEY_ID["args"]
    args_at = np.full(n_ev, np.iinfo(np.int64).max)
    ia = np.flatnonzero(is_args)
    ia = ia[np.r_[True, ev[ia][1:] != ev[ia][:-1]]] if len(ia) else ia
    args_at[ev[ia]] = K[ia]  # the first "args" of each event
    top = K < args_at[ev]
    n_top = len(TOP_KEYS)
    field_ok = np.where(kid < n_top, top, ~top) & ~is_args
    rows = {}
    valid = np.flatnonzero(field_ok)
    by_key = valid[np.argsort(kid[valid], kind="stable")]  # grouped by key, in file order within each
    bounds = np.searchsorted(kid[by_key], np.arange(len(_KEYS) + 1))
    for name, i in _KEY_ID.items():
        r = by_key[bounds[i]:bounds[i + 1]]
        if len(r) > 1:  # the first of each event
            r = r[np.r_[True, ev[r][1:] != ev[r][:-1]]]
        rows[name] = r
    return rows


def _kept_categories(A: np.ndarray, keys: _Keys, rows: dict[str, np.ndarray]) -> np.ndarray:
    """Per event: the index in KEPT_CATS of its category when it is a complete event ("ph": "X") of a
    kept one, else -1."""
    Q, kqh, ev, V, n_ev = keys.Q, keys.kqh, keys.ev, keys.V, keys.n_ev
    r = rows["ph"]
    vx = V[r]
    is_x = np.zeros(n_ev, bool)
    is_x[ev[r]] = (A[vx] == 34) & (A[vx + 1] == 88) & (A[vx + 2] == 34)
    r = rows["cat"]
    cat = np.full(n_ev, -1, np.int16)
    r = r[is_x[ev[r]] & (A[V[r]] == 34)]
    if len(r):
        start = V[r] + 1
        stop = Q[np.minimum(kqh[r] + 2, len(Q) - 1)]
        fp = _fingerprint(A, stop, stop - start)
        pos = np.minimum(np.searchsorted(_CAT_FP_SORTED, fp), len(KEPT_CATS) - 1)
        m = np.flatnonzero(_CAT_FP_SORTED[pos] == fp)
        ci = _CAT_FP_ORDER[pos[m]]
        for c in np.unique(ci):  # the fingerprint narrows, the bytes decide
            cb = KEPT_CATS[c].encode()
            sel = m[ci == c]
            sel = sel[(sliding_window_view(A, len(cb))[start[sel]] == np.frombuffer(cb, np.uint8)).all(1)]
            cat[ev[r[sel]]] = c
    return cat


def _kept_by_name(buf: bytes, A: np.ndarray, keys: _Keys, rows: dict[str, np.ndarray], cat: np.ndarray,
                  cand: np.ndarray, is_gpu: bool, name_ok: dict) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """The candidates (events of a kept category) whose name keeps them, whether each has a name, and
    the names' raw bytes: on a GPU trace CPU ops and runtime calls are kept by name (name_ok caches each
    name's answer across chunks)."""
    Q, kqh, ev, V = keys.Q, keys.kqh, keys.ev, keys.V
    where = np.full(keys.n_ev, -1, np.int64)
    r = rows["name"]
    where[ev[r]] = r
    nr = where[cand]
    has_name = nr >= 0
    nr = nr[has_name]
    if (A[V[nr]] != 34).any():
        raise _NotLayout
    texts = [buf[a:b] for a, b in zip((V[nr] + 1).tolist(), Q[kqh[nr] + 2].tolist())]
    keep = np.ones(len(cand), bool)
    for ci in (_CPU_OP, _RUNTIME, _DRIVER):
        pattern = name_rule(KEPT_CATS[ci], is_gpu)
        if pattern is None:  # every name of this category is kept
            continue
        sel = np.flatnonzero(cat[cand] == ci)
        if not len(sel):
            continue
        seen = name_ok.setdefault(ci, {})
        text_at = np.cumsum(has_name) - 1  # position in texts of each candidate with a name
        for j in sel:
            t = texts[text_at[j]] if has_name[j] else b""
            ok = seen.get(t)
            if ok is None:
                ok = seen[t] = bool(pattern.search(_json_string(t)))
            keep[j] = ok
    if not keep.all():
        texts = [t for t, k in zip(texts, keep[has_name].tolist()) if k]
        cand, has_name = cand[keep], has_name[keep]
    return cand, has_name, texts


def _add_events(buf: bytes, A: np.ndarray, keys: _Keys, rows: dict[str, np.ndarray], cat: np.ndarray,
                cand: np.ndarray, has_name: np.ndarray, texts: list[bytes], cols: _Columns) -> None:
    """The kept events' columns (names and strings interned, every number parsed at once) into cols."""
    Q, kqh, ev, V, n_ev = keys.Q, keys.kqh, keys.ev, keys.V, keys.n_ev
    n = len(cand)
    kept_at = np.full(n_ev, -1, np.int64)
    kept_at[cand] = np.arange(n)
    arg_rows = {}
    for col, key in ARG_STR.items():  # strings in args (collectives only); checked before anything is interned
        r = rows[key]
        r = r[kept_at[ev[r]] >= 0]
        if (A[V[r]] != 34).any():
            raise _NotLayout
        arg_rows[col] = r
    out: dict[str, np.ndarray] = {}
    name_codes = np.full(n, -1, np.int32)
    name_codes[has_name] = cols.code_raw("name", texts)
    out["name"] = name_codes
    cat_of = cat[cand]
    present, first = np.unique(cat_of, return_index=True)
    cat_codes = np.full(len(KEPT_CATS), -1, np.int32)
    for ci in present[np.argsort(first)]:  # interned in order of appearance, as the decoder would
        cat_codes[ci] = cols.code("cat", KEPT_CATS[ci])
    out["cat"] = cat_codes[cat_of]
    # numbers: every field of every kept event parsed at once
    num_fields = [("ts", "ts", True), ("dur", "dur", True), ("pid", "pid", False), ("tid", "tid", False)]
    num_fields += [(col, key, False) for col, key in ARG_INT.items()]
    at = [rows[key][kept_at[ev[rows[key]]] >= 0] for _, key, _ in num_fields]
    parsed = {}
    for is_float in (True, False):  # apart: the integers are shorter, their loop ends sooner
        group = [r for (_, _, f), r in zip(num_fields, at) if f == is_float]
        parsed[is_float] = _parse_numbers(A, V[np.concatenate(group)])
    offset = {True: 0, False: 0}
    for (col, key, is_float), r in zip(num_fields, at):
        num, frac, neg, ok = parsed[is_float]
        sl = slice(offset[is_float], offset[is_float] + len(r))
        offset[is_float] += len(r)
        dest = kept_at[ev[r]]
        if is_float:
            good = ok[sl] & (num[sl] <= _TWO53)  # exact in a double, then one rounding: as float() reads it
            v = num[sl] / _POW10[np.minimum(frac[sl], 18)]
            a = np.zeros(n, np.float64)
            conv = _as_float
        else:
            good = ok[sl] & (frac[sl] == 0)
            v = num[sl]
            a = np.full(n, -1, np.int64)
            conv = _as_int
        a[dest] = np.where(neg[sl], -v, v)
        for j in np.flatnonzero(~good):  # the rare values not plain decimals: one at a time
            a[dest[j]] = conv(_token(buf, int(V[r[j]])))
        out[col] = a
    for col, r in arg_rows.items():
        if len(r):
            a = np.full(n, -1, np.int32)
            a[kept_at[ev[r]]] = cols.code_raw(col, [buf[s + 1:e] for s, e in zip(V[r].tolist(), Q[kqh[r] + 2].tolist())])
            out[col] = a
    cols.add(out, n)
