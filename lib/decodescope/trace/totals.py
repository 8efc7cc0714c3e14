"""One rank file reduced: what the C reduction (creduce.py) and the numpy one (stream.py) both return, and
the streamed breakdown (breakdown.py) sums."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, Union

if TYPE_CHECKING:  # the numpy reduction's arrays; the module itself stays numpy-free (creduce.py's lists)
    import numpy as np


@dataclass
class RankTotals:
    """One rank file reduced: per name (code = position in `names`), the GPU work's duration and rows,
    and the CPU ops' self time, counted calls, duration and rows."""
    names: list[str]
    kernel_rows: int
    gpu_dur_us: Union[Sequence[float], np.ndarray]
    gpu_rows: Union[Sequence[int], np.ndarray]
    cpu_time_us: Union[Sequence[float], np.ndarray]
    cpu_calls: Union[Sequence[int], np.ndarray]
    cpu_dur_us: Union[Sequence[float], np.ndarray]
    cpu_rows: Union[Sequence[int], np.ndarray]
    cpu_read: bool  # were the CPU ops reduced (a file whose header names a GPU skips them)
    warnings: list[str] = field(default_factory=list)
    # chunks by the reader that read them: "c_reduce" (creduce.py), "c" (the C scanner), "numpy"
    chunks_by_reader: dict[str, int] = field(default_factory=dict)
