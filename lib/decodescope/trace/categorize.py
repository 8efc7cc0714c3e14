"""Kernel and op names -> categories, by the ordered rules of params/kernel_categories.yaml."""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd
import yaml

DEFAULT_RULES = Path(__file__).resolve().parents[3] / "params" / "kernel_categories.yaml"
OTHER = "other"
COMM_CATEGORIES_GPU = ("allreduce_nccl", "allreduce_custom", "allgather", "reduce_scatter", "all_to_all",
                       "ep_dispatch_combine", "send_recv")
COMM_CATEGORIES_CPU = ("allreduce", "allgather", "collective_other")
ALLREDUCE_CATEGORIES = ("allreduce_nccl", "allreduce_custom", "allreduce")


@dataclass(frozen=True)
class Rule:
    category: str
    regex: re.Pattern


@dataclass(frozen=True)
class RuleSet:
    gpu: tuple[Rule, ...]
    cpu: tuple[Rule, ...]

    def rules(self, device: str) -> tuple[Rule, ...]:
        return self.gpu if device == "gpu" else self.cpu


def load_rules(path: Optional[Path] = None) -> RuleSet:
    path = Path(path or DEFAULT_RULES)
    raw = yaml.safe_load(path.read_text())
    sets = {}
    for device in ("gpu", "cpu"):
        rules = []
        for i, r in enumerate(raw.get(device) or []):
            try:
                rules.append(Rule(r["category"], re.compile(r["pattern"], re.I)))
            except (KeyError, re.error) as e:
                raise ValueError(f"{path}: {device}[{i}]: bad rule {r!r} ({e}); each rule needs "
                                 "category and a valid regex pattern") from None
        sets[device] = tuple(rules)
    return RuleSet(**sets)


@lru_cache(maxsize=1)
def default_rules() -> RuleSet:
    return load_rules(DEFAULT_RULES)


def demangle(names: Iterable[str]) -> dict[str, str]:
    """Itanium-mangled names (_Z...) through c++filt in one batch; others unchanged."""
    names = list(dict.fromkeys(names))
    mangled = [n for n in names if n.startswith("_Z")]
    out = {n: n for n in names}
    if mangled and shutil.which("c++filt"):
        res = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True, timeout=60)
        for src, dst in zip(mangled, res.stdout.splitlines()):
            out[src] = dst
    return out


def categorize_name(name: str, device: str = "gpu", rules: Optional[RuleSet] = None) -> str:
    for rule in (rules or default_rules()).rules(device):
        if rule.regex.search(name):
            return rule.category
    return OTHER


def categorize_names(names: Iterable[str], device: str, rules: Optional[RuleSet] = None) -> dict[str, str]:
    plain = demangle(names)
    return {n: categorize_name(d, device, rules) for n, d in plain.items()}


def add_categories(df: pd.DataFrame, device: str, rules: Optional[RuleSet] = None) -> pd.DataFrame:
    """A `category` column, computed once per distinct name (through the name's categorical codes,
    so long kernel names are never copied per row)."""
    import numpy as np

    names = df["name"] if isinstance(df["name"].dtype, pd.CategoricalDtype) else df["name"].astype("category")
    names = names.cat.remove_unused_categories()
    distinct = [str(n) for n in names.cat.categories]
    mapping = categorize_names(distinct, device, rules)
    labels = sorted(set(mapping.values()))
    index = {c: i for i, c in enumerate(labels)}
    code_of_name = np.array([index[mapping[n]] for n in distinct] + [-1], dtype=np.int32)
    codes = code_of_name[names.cat.codes.to_numpy()]  # code -1 (missing name) maps to the -1 sentinel
    df = df.assign(name=names)
    df["category"] = pd.Categorical.from_codes(codes, categories=labels) if labels else pd.Categorical([None] * len(df))
    return df
