"""Plotly figure builders and the HTML report."""
