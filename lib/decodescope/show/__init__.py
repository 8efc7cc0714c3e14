"""Layer 2, show: how a notebook shows a note, a table or a figure, and the one place text is escaped."""
