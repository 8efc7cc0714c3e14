"""Put on PYTHONPATH by decodescope's forced-AVX2 switch (decodescope.exec.engine_comm, DECODESCOPE_CPU_PATH=avx2):
every Python process started under it sees a CPU without AVX-512 and AMX, as an AVX2-only x86 host is.

vLLM CPU picks its kernel library by `torch.cpu._is_avx512_supported()` (vllm/platforms/cpu.py,
import_kernels): `_C` or `_C_AVX512` with it, `_C_AVX2` without, and `_C_AVX2` has no shared-memory
all-reduce, so the engine all-reduces through gloo. The probes find what vLLM finds. torch's own
kernels are held to AVX2 by ATEN_CPU_CAPABILITY and oneDNN's by ONEDNN_MAX_CPU_ISA, which the switch
sets beside this file. Nothing is imported at start-up: torch.cpu is patched when something imports it.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_FALSE = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
          "_is_amx_tile_supported", "_is_amx_fp16_supported")


def _patch(module) -> None:
    for name in _FALSE:
        if hasattr(module, name):
            setattr(module, name, lambda: False)


class _AVX2Only(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)
        spec.loader.exec_module = exec_and_patch
        return spec


if "torch.cpu" in sys.modules:
    _patch(sys.modules["torch.cpu"])
else:
    sys.meta_path.insert(0, _AVX2Only())

# run the sitecustomize this one hides (the interpreter imports only the first found), if there is one
_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
