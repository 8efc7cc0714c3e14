"""Data types: their names and how many bytes an element takes. The one table of the package.

Three kinds of names reach it.
The params use short names (`bf16`, `fp8`, `int4`).
HF and torch use names such as `bfloat16` and `torch.float16`.
A profiler trace records ScalarType names for a collective's input (`BFloat16`, `Half`, `Float`, `Long`).
The function `canonical()` maps them all to the short names.

The int4 type is weight-only quantization (W4A16), as Kimi-K2.5 INT4 and vLLM's Marlin kernels run it.
Two weights are packed in a byte.
One 16-bit (bf16/fp16) scale goes with every `group_size` weights along K.
Scale bytes are counted per weight, i.e. `0.5 + 2 / group_size` bytes per weight.
That is 0.5625 at group 32 and 0.515625 at group 128.
The scheme is symmetric, so no zero points are counted.
An asymmetric scheme would add a packed 4-bit zero, 0.5 / group_size bytes per weight.
The activations stay 16-bit.
"""
from __future__ import annotations

import math
from typing import Optional

# canonical short name -> bytes per element (int4: the packed weight alone; see bytes_per_element)
ELEMENT_BYTES: dict[str, float] = {
    "fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "int4": 0.5,
}
# every other spelling -> canonical (compared lower-case, with any `torch.` prefix dropped)
ALIASES: dict[str, str] = {
    "float64": "fp64", "double": "fp64",
    "float32": "fp32", "float": "fp32", "tf32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16",
    "float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2": "fp8", "float8_e5m2fnuz": "fp8",
    "e4m3": "fp8", "e5m2": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8",
    "long": "int64", "int": "int32", "short": "int16", "char": "int8", "byte": "uint8",
    "w4a16": "int4", "uint4": "int4", "uint4b8": "int4",
}
INT4_SCALE_BYTES = 2        # one bf16/fp16 scale per group
INT4_GROUP_SIZE = 32        # Kimi-K2.5 INT4 (compressed-tensors, symmetric, group 32)


def canonical(name: object) -> Optional[str]:
    """The short name of a dtype spelled any known way; None for an unknown or missing name."""
    if name is None or (isinstance(name, float) and math.isnan(name)):
        return None
    key = str(name).strip().lower().removeprefix("torch.")
    if key in ELEMENT_BYTES:
        return key
    return ALIASES.get(key)


def bytes_per_element(dtype: str, group_size: int = INT4_GROUP_SIZE) -> float:
    """Bytes one element takes in memory; for int4 weights, with the group's scale shared out (module
    docstring). Raises KeyError naming the known dtypes for an unknown one."""
    name = canonical(dtype)
    if name is None:
        raise KeyError(f"unknown dtype {dtype!r}; known: {sorted(ELEMENT_BYTES)} and their usual spellings")
    if name == "int4":
        if group_size < 1:
            raise ValueError(f"int4 group_size must be >= 1, got {group_size}")
        return ELEMENT_BYTES["int4"] + INT4_SCALE_BYTES / group_size
    return float(ELEMENT_BYTES[name])


def element_bytes(dtype: object) -> float:
    """Bytes per element of an unpacked dtype (activations, collectives' buffers, a trace's recorded
    dtype); NaN when the name is unknown or missing (a trace may record anything), and for int4, whose
    size depends on its grouping (use bytes_per_element)."""
    name = canonical(dtype)
    if name is None or name == "int4":
        return math.nan
    return float(ELEMENT_BYTES[name])
