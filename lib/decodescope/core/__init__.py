"""Layer 1, core: files, units, statistics, the run directory and the one phase registry. The standard library,
numpy and pandas only; imports nothing else of decodescope."""
