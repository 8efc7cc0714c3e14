"""Layer 6, measure: the serving sweep, its client, telemetry and metrics."""
