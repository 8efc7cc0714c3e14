"""A server's own temporary folder: made and held (flock) by whoever starts the server, its TMPDIR and socket
folder while it runs, removed at its teardown; one nobody holds any more (its maker killed outright) is swept
by the next start in the same place. An engine's compile caches under TMPDIR are linked from it to beside it,
so they outlive it (decodescope.engines Engine.tmp_caches).
"""
from __future__ import annotations

import fcntl
import getpass
import os
import re
import shutil
import time
from pathlib import Path
from typing import Iterable, Optional

PRIVATE_DIR_PREFIX = "decodescope-tmp-"
# in a private folder, the file its maker holds flock'ed while the folder is in use: a folder whose lock
# anyone can take was left by a maker killed outright (flock dies with the process)
_HELD_FILE = ".held"
# a folder made this recently may be between its mkdir and its maker's flock
_SWEEP_MIN_AGE_S = 10.0


def server_tmp_dir(token: str, tmp_dir: str) -> str:
    """A server's own temporary folder, of its run token, in tmp_dir (short: a socket bound in it has a path
    of at most 107 bytes)."""
    return f"{tmp_dir.rstrip('/')}/{PRIVATE_DIR_PREFIX}{token[:12]}"


def link_tmp_caches(private_dir: str, names: Iterable[str]) -> list[str]:
    """Each cache folder an engine keeps under TMPDIR (decodescope.engines Engine.tmp_caches, "{user}" in a
    name: this user's, sanitized as torch's inductor does) made beside private_dir, and linked to from inside
    it: the server's own TMPDIR is removed at teardown (rmtree unlinks a link, never its target), and a cache
    in it would be rebuilt at every start. The links made; one that cannot be made is left out (the server
    then builds that cache in its own folder, as it would without this)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    parent = os.path.dirname(private_dir.rstrip("/"))
    links = []
    for name in names:
        target = os.path.join(parent, name.format(user=user))
        link = os.path.join(private_dir, name.format(user=user))
        try:
            os.makedirs(target, exist_ok=True)
            if not os.path.lexists(link):
                os.symlink(target, link)
        except OSError:
            continue
        links.append(link)
    return links


def hold_private_dir(path: str) -> int:
    """Make the folder (owner only) and hold its lock; the open descriptor, which keeps the lock until it is
    closed or this process dies (child processes do not inherit it: Popen closes it in them)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(path, _HELD_FILE), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def sweep_private_dirs(parent: str, now: Optional[float] = None) -> list[str]:
    """Remove the private folders in `parent` that nobody holds: left by a run killed outright (SIGKILL),
    whose server died with it but whose teardown never ran. The ones removed."""
    now = time.time() if now is None else now
    removed = []
    for d in sorted(Path(parent).glob(f"{PRIVATE_DIR_PREFIX}*")):
        held = d / _HELD_FILE
        try:
            if now - held.stat().st_mtime < _SWEEP_MIN_AGE_S:
                continue
            fd = os.open(held, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # no lock file (not made by hold_private_dir), or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: in use
        finally:
            os.close(fd)
        removed += remove_dirs([str(d)])
    return removed


def remove_dirs(paths: Iterable[str]) -> list[str]:
    """Remove these folders and what is in them; the ones that were there."""
    removed = []
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
