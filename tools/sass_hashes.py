"""Hashes of the sm_90 SASS of the FP8 kernels (norm + quant, silu + quant, the one-shot allreduce
+ norm + quant) for a fixed set of launch configurations, compiled offline: no GPU needed.

A change meant to leave some launches' machine code alone (a helper split out, a new constexpr
branch) is checked by running this on the tree before and after and diffing the two outputs:

    PYTHONPATH=<old tree> python tools/sass_hashes.py > old.txt
    PYTHONPATH=. python tools/sass_hashes.py > new.txt && diff old.txt new.txt

It runs as a script, not as python -m tools.sass_hashes: -m would put the working directory first on
the module path, and fusion_passes would come from there instead of PYTHONPATH's tree.

Kernel arguments get bf16 pointers (the codes uint8, the scales fp32), fp32 eps / weight_offset,
int32 otherwise, and 16-byte divisibility as the launches' specialisation gives it.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402



def _kernel_module(name: str, before_the_layout: str):
    """fusion_passes.lowering.NAME, or in a tree from before the one-folder-per-family layout
    (compared against this one), fusion_passes.lowering.BEFORE_THE_LAYOUT."""
    try:
        return importlib.import_module(f"fusion_passes.lowering.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"fusion_passes.lowering.{before_the_layout}")


allreduce = _kernel_module("allreduce_rms_norm_quant_fp8.symm_mem", "allreduce_add_rms_norm_quant_fp8_symm_mem")
norm = _kernel_module("rms_norm_quant_fp8.triton", "rms_norm_quant_fp8_triton")
silu = _kernel_module("silu_mul_quant_fp8.triton", "silu_mul_quant_fp8_triton")

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
POINTERS = {"q_ptr": "*u8", "scale_ptr": "*fp32", "peer_buffers_ptr": "*i64", "peer_signals_ptr": "*i64",
            "epochs_ptr": "*i32"}  # fmt: skip
DIVISIBLE = ("N", "group_size", "stride_x", "stride_residual", "stride_gate", "stride_up")
SCHEMES = ("static", "per_token", "per_group")


def sass_hash(kernel, constants: dict, num_warps: int) -> str:
    """The first 12 hex digits of sha256 over the kernel's SASS instructions (addresses kept)."""
    names = kernel.arg_names
    signature = {
        a: POINTERS.get(a, "*bf16")
        if a.endswith("_ptr")
        else "fp32"
        if a in ("eps", "weight_offset")
        else "i32"
        for a in names
    }
    signature.update(dict.fromkeys(constants, "constexpr"))
    attrs = {
        (names.index(a),): [["tt.divisibility", 16]] for a in names if a.endswith("_ptr") or a in DIVISIBLE
    }
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [CUOBJDUMP, "--dump-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    body = "\n".join(line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))
    return hashlib.sha256(body.encode()).hexdigest()[:12]


def main() -> None:
    norm_kernel = norm._rms_norm_quant_fp8_kernel
    padded = {"CHUNKS": 1} if "CHUNKS" in norm_kernel.arg_names else {}  # the padded block's launch
    if "WEIGHT_FIRST" in norm_kernel.arg_names:  # rows as loaded, not made to depend on the weight
        padded["WEIGHT_FIRST"] = False
    for residual, scheme, ue8m0, (groups, group) in itertools.product(
        (False, True), SCHEMES, (False, True), ((1, 8192), (64, 128), (1, 4096))
    ):
        if (groups > 1) != (scheme == "per_group"):
            continue
        constants = dict(HAS_RESIDUAL=residual, CAST_BEFORE_WEIGHT=True, STATIC=scheme == "static",
                         SCALE_UE8M0=ue8m0, AMAX_TIMES_RECIPROCAL=True, HW_FP8_CONVERT=True,
                         BLOCK_GROUPS=groups, BLOCK_GROUP=group, ROWS_PER_PROGRAM=1, **padded)  # fmt: skip
        print("norm", residual, scheme, ue8m0, groups, group, sass_hash(norm_kernel, constants, 4))
    for scheme, ue8m0 in itertools.product(SCHEMES, (False, True)):
        groups, group, tail = {
            "per_group": (8, 128, 0),
            "static": (1, 2048, 0),
            "per_token": (1, 16384, 2048),
        }[scheme]
        constants = dict(STATIC=scheme == "static", SCALE_UE8M0=ue8m0, AMAX_TIMES_RECIPROCAL=True, HW_CONVERT=True,
                         SILU_FORM=0, BLOCK_GROUPS=groups, BLOCK_GROUP=group, BLOCK_TAIL=tail,
                         ROWS_PER_PROGRAM=1)  # fmt: skip
        print("silu", scheme, ue8m0, sass_hash(silu._silu_mul_quant_fp8_kernel, constants, 4))
    for residual, scheme, ue8m0 in itertools.product((False, True), SCHEMES, (False, True)):
        groups, group = (64, 128) if scheme == "per_group" else (1, 8192)
        constants = dict(WORLD=2, HAS_RESIDUAL=residual, CAST_BEFORE_WEIGHT=True, STATIC=scheme == "static",
                         SCALE_UE8M0=ue8m0, AMAX_TIMES_RECIPROCAL=True, HW_FP8_CONVERT=True, BLOCK_N=8192,
                         BLOCK_GROUPS=groups, BLOCK_GROUP=group, ROWS_PER_PROGRAM=1)  # fmt: skip
        kernel = allreduce._one_shot_allreduce_add_rms_norm_quant_fp8_kernel
        print("allreduce", residual, scheme, ue8m0, sass_hash(kernel, constants, 16))


if __name__ == "__main__":
    main()
