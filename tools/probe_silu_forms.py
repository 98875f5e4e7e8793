"""Which cheap silu formulas round to eager's bf16 / fp16 silu on every 16-bit input (one GPU).

Each formula runs on all 65536 values of the dtype (NaN, inf and subnormals included), its fp32
result rounded to the dtype, against torch's F.silu on the same GPU; prints the mismatches and
the first inputs that differ. silu_triton's bf16_mufu form is formula 5 of this
list, as inline PTX; the others are why it is that one (see docs/notes/benchmarks-history.md).

    python -m tools.probe_silu_forms [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fusion_passes.lowering.silu_mul_quant_fp8.silu import FORM_DIV_RN, silu_rounded

LOG2E = tl.constexpr(1.4426950408889634)
FORMULAS = {
    0: "libdevice expf + div.rn (the kernel's div_rn form)",
    1: "ex2.approx.ftz + rcp.approx.ftz",
    2: "ex2.approx.ftz + rcp.approx.ftz, one correction of the quotient",
    3: "libdevice expf + rcp.approx.ftz",
    4: "libdevice expf + rcp.approx.ftz, one correction of the quotient",
    5: "ex2.approx.ftz + div.full.f32 (Triton's '/')",
    6: "ex2.approx.ftz with the product's rounding error folded in + rcp.approx.ftz",
    7: "ex2.approx.ftz + rcp.approx (no ftz)",
    8: "ex2.approx.ftz + rcp.approx.ftz refined once",
}


@triton.jit
def _asm(v, op: tl.constexpr):
    return tl.inline_asm_elementwise(op, "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _formula(x, C: tl.constexpr):
    if C == 0:
        return silu_rounded(x, tl.float32, True, FORM_DIV_RN)
    if C == 3 or C == 4:
        e = libdevice.exp(x * -1.0)
    elif C == 6:
        t = x * -LOG2E
        e2 = _asm(t, "ex2.approx.ftz.f32 $0, $1;")
        e = tl.fma(e2, tl.fma(x, -LOG2E, t * -1.0) * 0.6931471805599453, e2)
    else:
        e = _asm(x * -LOG2E, "ex2.approx.ftz.f32 $0, $1;")
    d = 1.0 + e
    if C == 5:
        return x / d
    if C == 7:
        return x * _asm(d, "rcp.approx.f32 $0, $1;")
    r = _asm(d, "rcp.approx.ftz.f32 $0, $1;")
    if C == 8:
        r = tl.fma(tl.fma(d * -1.0, r, 1.0), r, r)
    q = x * r
    if C == 2 or C == 4:
        q = tl.fma(tl.fma(q, d, x * -1.0) * -1.0, r, q)
    return q


@triton.jit
def _kernel(x_ptr, out_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, _formula(x, C).to(x_ptr.dtype.element_ty), mask=mask)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    results = {}
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
        ref = F.silu(x)
        for c, name in FORMULAS.items():
            out = torch.empty_like(x)
            _kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), C=c, BLOCK=1024)
            same = (out.view(torch.int16) == ref.view(torch.int16)) | (out.isnan() & ref.isnan())
            bad = (~same).nonzero().flatten()
            first = [(x[i].item(), out[i].item(), ref[i].item()) for i in bad[:6].tolist()]
            results[f"{dtype}/{c}"] = dict(formula=name, mismatches=bad.numel(), first=first)
            print(f"{str(dtype):15s} {c} {name:72s} {bad.numel():6d} {first[:3]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
