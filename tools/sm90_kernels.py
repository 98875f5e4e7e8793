"""The kernels of a built-in model's decode step (or prefill) as Inductor writes them for one H200
(sm_90), on a machine without a GPU: stock Inductor against fusion_passes, launches per layer by class (GEMM,
attention, MoE, other) and the "other" kernels by name. No timing: launch counts only.

    python -m tools.sm90_kernels deepseek-v3.2 [--context 40] [--batch 1] [--layers 2] [--prefill N]
        [--opt-in sparse_attention_mask ...] [--inductor combo_kernels=True] [--code out.py] [--stock-code stock.py] [--json out.json]

How: the step (a StaticCache decode step, models/decode.py) is traced by torch.compile on the CPU
and its ATen graph taken where Inductor receives it; its device constants become cuda:0 and its
inputs fake CUDA tensors; Inductor then compiles it for sm_90 (device queries answered as one
H200's, Triton's target set to sm_90, a CUDA device guard registered for the fake tensors) and
stops at the generated code, whose launches are counted.

What differs from the GPU's code (measured counts are the GPU's, from bench_decode):
- the graph is the CPU's trace: model code branching on the device takes its CPU side, and SDPA
  is decomposed into its math form (its CUDA kernel choice is a C++ dispatch stub
  a CPU build lacks): its kernels are counted as attention, by their source (the SDPA call's
  result, ``attn_output``), so the mask and cast kernels around a GPU's SDPA are not all seen;
- Inductor's shape padding is off and constant folding of CUDA values skipped (both need a GPU).
One CPU side is turned into the GPU's before compiling: transformers' grouped_mm experts count the
sorted expert ids with histc on a float copy on the CPU (no integer histc there) and on an int32
copy on a GPU; the copy's dtype is set to int32 (the same counts), so that moe_sort_by_expert sees
the GPU's dispatch.
The tiny configs keep each layer's structure, so counts per layer compare; sizes do not.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import types
from collections import Counter

import torch

from fusion_passes.kernels import classify_kernel

_H200 = types.SimpleNamespace(
    name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, warp_size=32, regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048, max_threads_per_block=1024, total_memory=140 << 30,
    shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472, L2_cache_size=50 << 20,
    gcnArchName="", clock_rate=1980000, memory_clock_rate=2619000, memory_bus_width=6144,
)  # fmt: skip


class _Generated(Exception):
    """Raised by Inductor's last step in place of loading the module: carries its source."""


def _capture_aten_graph(step, inputs):
    """(graph module, example inputs, compile kwargs) as Inductor's inner compile receives them."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    captured = {}

    class _Captured(Exception):
        pass

    def inner(gm, example_inputs, **kwargs):
        captured.update(gm=gm, inputs=example_inputs, kwargs=kwargs)
        raise _Captured

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False):
        try:
            torch.compile(step, backend=backend, fullgraph=True)(*inputs)
        except Exception as e:  # dynamo wraps the backend's exception
            if "gm" not in captured:
                raise e
    return captured["gm"], captured["inputs"], captured["kwargs"]


def _as_one_h200() -> None:
    """Answer CUDA's device queries as one H200 and compile Triton for sm_90 (for this process)."""
    import triton
    from torch._dynamo.device_interface import CudaInterface
    from torch.utils.cpp_extension import load_inline
    from triton.backends.compiler import GPUTarget

    # Python indexing of a fake CUDA tensor sets a device guard, which a CPU build lacks.
    load_inline(
        "fusion_passes_fake_cuda_guard",
        cpp_sources="#include <c10/core/impl/FakeGuardImpl.h>\n"
        "C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);\nvoid noop() {}\n",
        functions=["noop"],
    )
    # Inductor's own pattern sets, traced once on the CPU (their CUDA trace needs real tensors).
    from torch._inductor.fx_passes import joint_graph, post_grad

    for module in (joint_graph, post_grad):
        module.lazy_init()
        module.lazy_init = lambda *a, _init=module.lazy_init, **k: _init()
    answers = {
        "get_device_properties": lambda *a, **k: _H200, "get_device_capability": lambda *a, **k: (9, 0),
        "get_device_name": lambda *a, **k: _H200.name, "current_device": lambda: 0, "is_available": lambda: True,
        "device_count": lambda: 1, "get_rng_state": lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda *a, **k: None, "synchronize": lambda *a, **k: None,
        "_exchange_device": lambda i: 0, "_maybe_exchange_device": lambda i: 0,
    }  # fmt: skip
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
    for name in ("get_device_properties", "current_device", "device_count", "synchronize"):
        setattr(CudaInterface, name, staticmethod(answers[name]))
    for name, answer in (("exchange_device", answers["_exchange_device"]), ("get_raw_stream", lambda *a: 0),
                         ("maybe_exchange_device", answers["_maybe_exchange_device"])):  # fmt: skip
        setattr(CudaInterface, name, staticmethod(answer))
    CudaInterface.Worker.get_device_properties = staticmethod(answers["get_device_properties"])
    CudaInterface.Worker.current_device = staticmethod(answers["current_device"])
    import torch._inductor.scheduler as scheduler

    scheduler.has_triton = lambda: True  # cached False at import on a machine without a GPU

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(_Sm90())
    import torch._inductor.constant_folding as constant_folding

    run_node = constant_folding.ConstantFolder.run_node

    def run_node_or_unknown(self, node):
        try:
            return run_node(self, node)
        except NotImplementedError:  # a real CUDA value, which this machine cannot make
            return self.unknown_value

    constant_folding.ConstantFolder.run_node = run_node_or_unknown
    import torch._inductor.graph as graph

    def generated(self):
        code = self.codegen()[0]
        raise _Generated(code if isinstance(code, str) else code.value)

    graph.GraphLowering.compile_to_module = generated


def _to_fake_cuda(gm, inputs):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    cuda = torch.device("cuda", 0)

    def swap(value):
        if isinstance(value, torch.device) and value.type == "cpu":
            return cuda
        return "cuda:0" if value == "cpu" else value

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, swap)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
    _histc_as_on_a_gpu(gm.graph)
    gm.recompile()
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        fakes = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=cuda) if isinstance(t, torch.Tensor) else t
            for t in inputs
        ]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return fakes, mode


def _histc_as_on_a_gpu(graph) -> int:
    """histc over a float32 copy of integer ids (transformers' CPU branch) -> over an int32 copy,
    as the GPU branch traces; returns how many were changed."""
    changed = 0
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.histc.default):
        copy = node.args[0]
        ids = copy.args[0] if getattr(copy, "target", None) == torch.ops.prims.convert_element_type.default else None
        val = getattr(ids, "meta", {}).get("val")
        if val is not None and not val.is_floating_point() and copy.args[1] == torch.float32 and len(copy.users) == 1:
            copy.args = (ids, torch.int32)
            changed += 1
    return changed


def generated_code(gm, inputs, kwargs, pass_manager, inductor_options: dict) -> str:
    """Inductor's sm_90 code of the (CPU-traced) ATen graph, with ``pass_manager`` as its post-grad pass."""
    import copy

    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    gm = copy.deepcopy(gm)
    fakes, mode = _to_fake_cuda(gm, inputs)
    keep = ("is_inference", "static_input_idxs", "graph_id", "boxed_forward_device_index", "cudagraphs")
    patches = {"fx_graph_cache": False, "shape_padding": False, "post_grad_custom_post_pass": pass_manager,
               **inductor_options}  # fmt: skip
    try:
        with torch._guards.tracing(torch._guards.TracingContext(mode)), inductor_config.patch(patches):
            compile_fx_inner(gm, fakes, **{k: v for k, v in kwargs.items() if k in keep})
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, _Generated):
            cause = cause.__cause__ or getattr(cause, "inner_exception", None)
        if cause is None:
            raise
        return cause.args[0]
    raise RuntimeError("Inductor returned without generating code")


_LAUNCH = re.compile(r"\n\s+(\w+)\.run\(|\n\s+(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.\w+\.\w+\.\w+)\(")


def launches(code: str) -> list[tuple[str, str]]:
    """(name, class) of each launch in the generated ``call``, in order."""
    sources = {}
    for block in code.split("\n\n\n"):
        found = re.search(r"# Topologically Sorted Source Nodes: \[([^\]]*)\]", block)
        name = re.search(r"^(\w+) = async_compile\.triton\(", block, re.M)
        if found and name:
            sources[name.group(1)] = [s.strip() for s in found.group(1).split(",")]
    call = code[code.index("def call("):]
    out = []
    for user, extern in _LAUNCH.findall(call):
        name = user or extern
        if extern:  # library calls: GEMMs, the grouped GEMM, SDPA, fallbacks
            cls = ("moe" if "grouped_mm" in name else "gemm" if re.search(r"\b(b?mm|addmm|baddbmm)\b", name)
                   else "attention" if "attention" in name else "other")  # fmt: skip
        elif sources.get(name) and all(s.startswith("attn_output") for s in sources[name]):
            cls = "attention"  # SDPA's math decomposition (module docstring)
        else:  # as bench_decode classes the profiler's names: Inductor's glue is "other" whatever it fused
            cls = classify_kernel(name)
        out.append((name, cls))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=40)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="a prefill of N tokens at batch 1 writing the cache, instead of a decode step")
    parser.add_argument("--opt-in", nargs="*", default=[], help="opt-in fusions added to the defaults")
    parser.add_argument("--inductor", nargs="*", default=[], help="Inductor options, NAME=VALUE (both variants)")
    parser.add_argument("--code", help="write fusion_passes' generated code here")
    parser.add_argument("--stock-code", help="write stock Inductor's generated code here")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

    import fusion_passes
    from benchmarks.bench_decode import inductor_settings
    from fusion_passes.models.decode import DecodeStep
    from fusion_passes.models.registry import build_model
    from fusion_passes.pass_manager import FusionPassManager
    from fusion_passes.registry import get_fusions

    options = inductor_settings(args.inductor)
    built = build_model(args.model, size="tiny", dtype=torch.bfloat16, layers=args.layers, device="cpu")
    if args.prefill:
        args.batch, args.context = 1, args.prefill
    step = DecodeStep(built.module, batch=args.batch, context=args.context, steps=2)
    step_inputs = (step.prompt, torch.arange(args.context)) if args.prefill else step.inputs(0)
    with torch.no_grad():
        step.restore()
        gm, inputs, kwargs = _capture_aten_graph(step, step_inputs)
    _as_one_h200()
    report = fusion_passes.Report()
    manager = FusionPassManager(get_fusions(["all", *args.opt_in]), report, False, False, "direct", True)
    variants = {"inductor": generated_code(gm, inputs, kwargs, None, options),
                "fusion_passes": generated_code(gm, inputs, kwargs, manager, options)}  # fmt: skip
    for path, name in ((args.code, "fusion_passes"), (args.stock_code, "inductor")):
        if path:
            with open(path, "w") as f:
                f.write(variants[name])
    counted = {name: launches(code) for name, code in variants.items()}
    if args.json:
        import json

        classes = ("gemm", "attention", "moe", "other")
        record = {
            "model": args.model, "batch": args.batch, "context": args.context, "layers": args.layers,
            "prefill": bool(args.prefill),
            "opt_in": args.opt_in, "fusions": {k: v for k, v in report.final().items() if v},
            "per_layer": {name: {c: sum(cls == c for _, cls in found) / args.layers for c in classes}
                          for name, found in counted.items()},
            "other": {name: dict(Counter(k for k, cls in found if cls == "other")) for name, found in counted.items()},
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    what = (f"prefill of {args.context} tokens" if args.prefill
            else f"decode step, batch {args.batch}, {args.context} cached tokens")  # fmt: skip
    print(f"{args.model} {what}, {args.layers} tiny layers; Inductor's sm_90 code")
    print("fusions:", {k: v for k, v in report.final().items() if v})
    print(f"{'launches per layer':24}" + "".join(f"{c:>12}" for c in ("gemm", "attention", "moe", "other", "all")))
    for name, found in counted.items():
        per_class = Counter(cls for _, cls in found)
        cells = [per_class[c] / args.layers for c in ("gemm", "attention", "moe", "other")] + [len(found) / args.layers]
        print(f"{name:24}" + "".join(f"{v:12.1f}" for v in cells))
    for name, found in counted.items():
        print(f"\n{name}: other kernels (launches in the step)")
        for kernel, n in Counter(k for k, cls in found if cls == "other").most_common():
            print(f"{n:4}  {kernel[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
