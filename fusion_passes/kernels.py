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
# Inductor's generated pointwise / reduction kernels are named after every op they absorbed: a
# copy of the keys fused with the SDPA call's mask is "triton_poi_fused__scaled_dot_product_
# cudnn_attention_..._clone_expand_..." (244 us a layer at MiniMax-M2's width, batch 64), and is
# glue, not attention. Only its templates (triton_tem_: GEMMs) take a class by name.
_INDUCTOR_GLUE = re.compile(r"^triton_(?:poi|per|red)_")


def classify_kernel(name: str) -> str:
    if _INDUCTOR_GLUE.match(name):
        return "other"
    for cls, pattern in _CLASSES:
        if pattern.search(name):
            return cls
    return "other"


def profile_kernels(fn, *args) -> list[tuple[str, float]]:
    """(name, GPU microseconds) of each CUDA kernel one call of ``fn`` launches, in launch order
    (needs a GPU; the call before the profiled one compiles and autotunes)."""
    import torch

    fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.time_range.elapsed_us()) for e in sorted(events, key=lambda e: e.time_range.start)]


def class_times(kernels: Iterable[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """Kernels and GPU microseconds per class: {"gemm": {"kernels": 4, "us": 31.2}, ...}."""
    out = {c: {"kernels": 0, "us": 0.0} for c in KERNEL_CLASSES}
    for name, us in kernels:
        entry = out[classify_kernel(name)]
        entry["kernels"] += 1
        entry["us"] += us
    return out


_COLLECTIVE = re.compile(r"nccl|all_?reduce|cross_device|multimem|one_shot", re.I)


def _boundary(name: str) -> str | None:
    """What a kernel outside "other" is, as a region boundary (collectives count: they split regions)."""
    if _COLLECTIVE.search(name):
        return "collective"
    cls = classify_kernel(name)
    return None if cls == "other" else cls


def what_is_left(kernels: list[tuple[str, float]], layers: int = 1) -> list[dict]:
    """The kernels outside GEMM / attention / MoE ("other"), grouped by name and the region they sit
    in (the boundary kernels before and after them: "gemm -> attention"), ranked by GPU time: the
    fusion candidates that no pass takes yet. ``per_layer`` divides the counts and times by
    ``layers`` (kernels outside every layer, such as the embedding or the final norm, count too)."""
    rows: dict[tuple[str, str], dict] = {}
    bounds = [_boundary(name) for name, _ in kernels]
    for i, (name, us) in enumerate(kernels):
        if bounds[i] is not None or classify_kernel(name) != "other":
            continue
        before = next((b for b in reversed(bounds[:i]) if b), "start")
        after = next((b for b in bounds[i + 1 :] if b), "end")
        region = f"{before} -> {after}"
        row = rows.setdefault((name, region), {"kernel": name, "region": region, "launches": 0, "us": 0.0})
        row["launches"] += 1
        row["us"] += us
    ranked = sorted(rows.values(), key=lambda r: -r["us"])
    for row in ranked:
        row["per_layer_us"] = row["us"] / layers
        row["per_layer_launches"] = row["launches"] / layers
    return ranked


def profile_kernel_names(fn, *args) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches, in launch order (needs a GPU)."""
    return [name for name, _ in profile_kernels(fn, *args)]


def profile_kernel_classes(fn, *args) -> dict[str, int]:
    """CUDA kernels one call of ``fn`` launches, counted per class (needs a GPU)."""
    return {c: v["kernels"] for c, v in class_times(profile_kernels(fn, *args)).items()}


# CUDA runtime / driver calls that make the host wait for the GPU: where a compiled step makes
# one, plain launches lose their overlap (the step costs host time + GPU time, not the larger).
_BLOCKING = re.compile(r"^(cuda|cu)(StreamSynchronize|DeviceSynchronize|EventSynchronize|Ctx[sS]ynchronize"
                       r"|Memcpy(?!Async|Peer)\w*|MemcpyDtoH\w*)$")  # fmt: skip
_LAUNCH = re.compile(r"^(cudaLaunchKernel\w*|cuLaunchKernel\w*|cudaGraphLaunch)$")


def host_costs(fn, *args) -> dict:
    """What one call of ``fn`` costs the host, from the profiler's CPU side: kernel launches,
    calls that block until the GPU is done (``blocking``, by name: synchronizes and synchronous
    copies), and fusion_passes ops reached through the dispatcher (``dispatched``, CPU
    microseconds by op: on CUDA every fused op should be a launch Inductor emits, none of these).
    The call before the profiled one compiles and warms."""
    import torch

    fn(*args)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    blocking: dict[str, int] = {}
    dispatched: dict[str, float] = {}
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        if _LAUNCH.match(e.name):
            launches += 1
        elif _BLOCKING.match(e.name):
            blocking[e.name] = blocking.get(e.name, 0) + 1
        elif e.name.startswith("fusion_passes::"):
            dispatched[e.name] = dispatched.get(e.name, 0.0) + e.time_range.elapsed_us()
    return {"launches": launches, "blocking": blocking, "dispatched": dispatched}
