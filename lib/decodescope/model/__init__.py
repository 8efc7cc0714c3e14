"""Layer 3, model: model architectures (a config.json read as layers, shapes and per-step collectives)."""
