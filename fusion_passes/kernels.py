"""Count the kernels in Inductor's generated code (what `fusion-passes diff` reports).

generated: kernels Inductor wrote and compiled (Triton on CUDA, C++ on CPU), one per definition,
           user Triton kernels launched directly (launch="direct") included;
fused_ops: calls of fusion_passes ops through the dispatcher (CPU reference, launch="dispatch");
extern:    calls of library kernels (GEMMs, attention, fallbacks).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_GENERATED = re.compile(r"=\s*async_compile\.(?:triton|cpp_pybinding|cpp)\(")
_FUSED_OP_CALL = re.compile(r"torch\.ops\.fusion_passes\.\w+\.\w+\(")
_EXTERN_CALL = re.compile(r"\bextern_kernels\.\w+\(|\btorch\.ops\.(?!fusion_passes\.)\w+\.\w+\.\w+\(")


def count_kernels(codes: Iterable[str]) -> dict[str, int]:
    """Kernel counts summed over the generated modules of one compile."""
    counts = {"generated": 0, "fused_ops": 0, "extern": 0}
    for code in codes:
        body = _strip_kernel_sources(code)
        counts["generated"] += len(_GENERATED.findall(code))
        counts["fused_ops"] += len(_FUSED_OP_CALL.findall(body))
        counts["extern"] += len(_EXTERN_CALL.findall(body))
    return counts


def _strip_kernel_sources(code: str) -> str:
    """The wrapper code alone: kernel sources are triple-quoted strings in the module."""
    return re.sub(r"'''.*?'''", "", code, flags=re.DOTALL)


# Kernel classes by name, as the CUDA profiler reports them (first match wins). "other" is what
# the fusions work on: norms, RoPE, quantization, elementwise glue.
_CLASSES = (
    ("moe", re.compile(r"grouped|moe|_experts|topk", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|attn", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|splitk|wgmma|_mm_|\bmm\b", re.I)),
)
KERNEL_CLASSES = ("gemm", "attention", "moe", "other")


def classify_kernel(name: str) -> str:
    for cls, pattern in _CLASSES:
        if pattern.search(name):
            return cls
    return "other"


def profile_kernel_names(fn, *args) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches, in launch order (needs a GPU)."""
    import torch

    fn(*args)  # warm: compile and autotune outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name for e in sorted(events, key=lambda e: e.time_range.start)]


def profile_kernel_classes(fn, *args) -> dict[str, int]:
    """CUDA kernels one call of ``fn`` launches, counted per class (needs a GPU)."""
    counts = dict.fromkeys(KERNEL_CLASSES, 0)
    for name in profile_kernel_names(fn, *args):
        counts[classify_kernel(name)] += 1
    return counts
