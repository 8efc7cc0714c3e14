"""Layer 5, exec: the programs decodescope runs on the GPU host (GEMMs, collectives, the step replay),
on the standard library and torch."""
