"""Layer 6, measure: traces read, reduced and categorized into per-rank tables (no run-directory knowledge)."""
