"""Layer 6, measure (with decodescope.trace and decodescope.serving): the micro-benchmarks run through the
probes and turned into tables."""
