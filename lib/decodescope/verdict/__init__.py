"""Layer 7, verdict: the step model, the one projection engine, the reconciliation and the findings, from
the typed records the phases wrote."""
