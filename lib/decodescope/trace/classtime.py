"""A step's time per verdict class: each category's time per step mapped to its class
(params/kernel_categories.yaml) and summed per rank. The profile's growth table, the verdict's attribution
and reconciliation, and the step model's samples all sum it this one way."""
from __future__ import annotations

import pandas as pd

from decodescope.trace.categorize import class_of


def class_time_per_step(per_step_categories: pd.DataFrame) -> pd.Series:
    """Per (rank, cls): the time per step (us) of the class's categories summed, from per-step category
    rows (rank, category, time_per_step_us)."""
    cls = per_step_categories["category"].astype(str).map(class_of)
    return per_step_categories.assign(cls=cls).groupby(["rank", "cls"])["time_per_step_us"].sum()
