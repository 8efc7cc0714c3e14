"""What a phase function is given: the params it runs under and its run directory (a variant's own, for a
variant). orchestration.notebook.open_phase makes one; the phases' functions (`*_for_phase`) take it,
write their records and return them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from decodescope.core.rundir import DATA
from decodescope.schema.params_schema import Params
from decodescope.schema.rundata import RunDir


@dataclass
class PhaseContext:
    params: Params
    run_dir: Path

    @property
    def run(self) -> RunDir:
        """The run directory's files, read through their records (schema.rundata)."""
        return RunDir(self.run_dir)

    @property
    def data_dir(self) -> Path:
        return self.run.data

    def data(self, name: str) -> Path:
        return self.run.file(name)

    def source(self, name: str) -> str:
        """'where this number came from' line for captions."""
        return f"{self.run_dir.name}/{DATA}/{name} (params: {self.params.run_name})"
