"""Kernel and op names -> categories, by the ordered rules of params/kernel_categories.yaml (shipped in
the package as decodescope/_data/params/kernel_categories.yaml)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from decodescope.core.resources import cache_dir, data_path

if TYPE_CHECKING:  # pandas only where a table is categorised: the streamed breakdown never imports it
    import pandas as pd

DEFAULT_RULES = data_path("params", "kernel_categories.yaml")  # shipped with the package (decodescope.core.resources)
OTHER = "other"  # the category, and the class, of names no rule matches
# What the verdict weighs against each other; every rule names one (model.py reads them from here).
VERDICT_CLASSES = ("communication", "gemm", "attention", "framework overhead", "small ops")
COMMUNICATION = "communication"
# What a communication rule's kernels do; `wait` is a rank blocked until its collective completes.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "dispatch_combine",
               "wait", "other")


@dataclass(frozen=True)
class Rule:
    category: str
    regex: re.Pattern
    verdict_class: str = OTHER
    collective: Optional[str] = None  # communication rules only


@dataclass(frozen=True)
class RuleSet:
    gpu: tuple[Rule, ...]
    cpu: tuple[Rule, ...]

    def rules(self, device: str) -> tuple[Rule, ...]:
        return self.gpu if device == "gpu" else self.cpu

    @cached_property
    def _classes(self) -> dict[str, str]:
        return {**{r.category: r.verdict_class for r in self.gpu + self.cpu}, OTHER: OTHER}

    def category_classes(self) -> dict[str, str]:
        """category -> verdict class, for every category of the file, plus `other` -> `other`."""
        return dict(self._classes)

    def class_of(self, category: str) -> str:
        # a category the file does not name (an old run's) is shown as `other`, not dropped
        return self._classes.get(str(category), OTHER)

    def categories(self, verdict_class: Optional[str] = None, collective: Optional[str] = None,
                   device: Optional[str] = None) -> tuple[str, ...]:
        """The categories with that class and/or collective, in rule order, each once."""
        rules = self.rules(device) if device else self.gpu + self.cpu
        picked = (r.category for r in rules
                  if (verdict_class is None or r.verdict_class == verdict_class)
                  and (collective is None or r.collective == collective))
        return tuple(dict.fromkeys(picked))


def _rule(path: Path, where: str, raw) -> Rule:
    """One rule of the file; errors name the file, the rule and what would be valid."""
    if not isinstance(raw, dict) or "category" not in raw or "pattern" not in raw:
        raise ValueError(f"{path}: {where}: bad rule {raw!r}; each rule needs category, class and pattern")
    if raw["category"] == OTHER:
        raise ValueError(f"{path}: {where}: category {OTHER!r} is reserved for names no rule matches; pick another")
    cls = raw.get("class")
    if cls not in VERDICT_CLASSES:
        raise ValueError(f"{path}: {where} ({raw['category']}): class {cls!r} is not a verdict class; "
                         f"valid: {', '.join(VERDICT_CLASSES)}")
    collective = raw.get("collective")
    if cls == COMMUNICATION:
        collective = collective or "other"
        if collective not in COLLECTIVES:
            raise ValueError(f"{path}: {where} ({raw['category']}): collective {collective!r} is not known; "
                             f"valid: {', '.join(COLLECTIVES)}")
    elif collective is not None:
        raise ValueError(f"{path}: {where} ({raw['category']}): collective is for class {COMMUNICATION} only, "
                         f"not {cls}")
    try:
        regex = re.compile(raw["pattern"], re.I)
    except re.error as e:
        raise ValueError(f"{path}: {where} ({raw['category']}): pattern is not a valid regex ({e})") from None
    return Rule(raw["category"], regex, cls, collective)


def _check_one_class_per_category(path: Path, rules: dict[str, Rule]) -> None:
    """A category's time is added up under one class: every rule of it must agree."""
    first: dict[str, tuple[str, Rule]] = {}
    for where, r in rules.items():
        seen = first.setdefault(r.category, (where, r))
        if (seen[1].verdict_class, seen[1].collective) != (r.verdict_class, r.collective):
            raise ValueError(f"{path}: {where} ({r.category}): class {r.verdict_class!r} / collective "
                             f"{r.collective!r} differ from {seen[0]} (class {seen[1].verdict_class!r} / "
                             f"collective {seen[1].collective!r}); a category has one class and one collective")


def load_rules(path: Optional[Path] = None) -> RuleSet:
    path = Path(path or DEFAULT_RULES)
    raw = _rules_document(path)
    by_place: dict[str, Rule] = {}
    sets = {}
    for device in ("gpu", "cpu"):
        rules = []
        for i, r in enumerate(raw.get(device) or []):
            where = f"{device}[{i}]"
            by_place[where] = _rule(path, where, r)
            rules.append(by_place[where])
        sets[device] = tuple(rules)
    _check_one_class_per_category(path, by_place)
    return RuleSet(**sets)


def _rules_document(path: Path) -> dict:
    """The rules file parsed: from a JSON copy in the user's cache when these very bytes were parsed
    before, else by PyYAML (libyaml's loader where it has it) and then cached. PyYAML's import and load
    cost ~30 ms, a fifth of `analyze-trace --breakdown` on a 20 MB trace; json is loaded already."""
    text = path.read_bytes()
    cached = cache_dir() / f"rules-{hashlib.sha256(text).hexdigest()[:16]}.json"
    try:
        return json.loads(cached.read_bytes())
    except (OSError, ValueError):
        pass
    # yaml only when the rules' JSON cache is stale (analyze-trace's start-up budget)
    import yaml

    try:
        raw = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")  # several processes may write it at once
        tmp.write_text(json.dumps(raw))
        os.replace(tmp, cached)
    except (OSError, TypeError, ValueError):  # a read-only home, or YAML that JSON cannot hold: not cached
        pass
    return raw


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


def add_categories(df: "pd.DataFrame", device: str, rules: Optional[RuleSet] = None) -> "pd.DataFrame":
    """A `category` column, computed once per distinct name (through the name's categorical codes,
    so long kernel names are never copied per row)."""
    # lean: analyze-trace --breakdown loads this module without numpy or pandas (cli.py's start-up budget)
    import numpy as np
    import pandas as pd

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


def category_classes() -> dict[str, str]:
    return default_rules().category_classes()


def class_of(category: str) -> str:
    return default_rules().class_of(category)


# Derived from the rules file, so a new communicator's rule lands in these sets by its class/collective.
ALLREDUCE_CATEGORIES = default_rules().categories(collective="all_reduce")
ALLGATHER_CATEGORIES = default_rules().categories(collective="all_gather")
WAIT_CATEGORIES = default_rules().categories(collective="wait")
COMM_CATEGORIES_GPU = default_rules().categories(COMMUNICATION, device="gpu")
COMM_CATEGORIES_CPU = default_rules().categories(COMMUNICATION, device="cpu")


# Which implementation ran an all-reduce, from its op or kernel name: the micro-benchmark row to set
# against the profile is the one of the same communicator (probes/collectives.py names them alike).
# NCCL kernels look the same whether torch.distributed or vLLM's pynccl launched them: "nccl".
COMMUNICATOR_PATTERNS = (
    ("vllm_shm", re.compile(r"shm_all_?reduce", re.I)),
    ("vllm_custom_ar", re.compile(r"cross_device_reduce|custom_?all_?reduce|_C_custom_ar", re.I)),
    ("vllm_quick_ar", re.compile(r"quick_?(all_?)?reduce|quickreduce", re.I)),
    ("flashinfer_ar", re.compile(r"lamport|allreduce_fusion|trtllm", re.I)),
    ("symm_mem", re.compile(r"symm_mem|one_shot_all_reduce|two_shot_all_reduce|multimem", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("torch_gloo", re.compile(r"gloo|c10d::allreduce_|_c10d_functional::all_reduce|c10d_functional::all_reduce", re.I)),
)


def communicator_of(name: str) -> str:
    for comm, pattern in COMMUNICATOR_PATTERNS:
        if pattern.search(name):
            return comm
    return "unknown"

