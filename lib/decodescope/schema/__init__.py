"""Layer 4, schema: the params file and every record a phase writes, typed and versioned."""
