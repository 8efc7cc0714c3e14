"""Layer 8, report: figures, sections, the report page, the runs index and the comparison."""
