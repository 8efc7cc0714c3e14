"""Layer 9, orchestration: the runner (phases in sequence through papermill), its manifest and progress,
and the notebooks' entry point."""
