"""Where commands run. Only this machine for now: `host: local` (params rejects ssh:// hosts with a
clear error until remote execution exists)."""
from __future__ import annotations

import subprocess
from typing import Optional


def run_local(argv: list[str], timeout_s: Optional[float] = None, env: Optional[dict] = None,
              cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
