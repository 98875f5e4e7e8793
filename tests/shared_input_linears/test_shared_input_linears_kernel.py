"""shared_input_linears' Triton kernel against its plain-torch reference (F.linear per weight): one
to four weights, token counts from one to past a program's four, row counts that do not fill a
program's tile (a single row: Qwen 3.5-MoE's shared_expert_gate), input sizes that do not fill a
block, a strided input, bf16 / fp16; on CPU tensors through Triton's interpreter, or on CUDA
tensors, compiled, where a GPU is present. Each output is the fp32 sum of exact products rounded
once: within half a unit in the last place of the dtype (plus the fp32 sum's order) of the exact
sum, so within one unit of cuBLAS's (or the CPU's) own rounding (the interpreter truncates bf16:
a whole unit there)."""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Chosen before triton is first imported; only without a GPU (see test_rms_norm_kernel.py).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from _hypothesis import examples  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fusion_passes  # noqa: E402,F401  (registers torch.ops.fusion_passes)
from fusion_passes.lowering.shared_input_linears.reference import shared_input_linears_reference  # noqa: E402
from fusion_passes.lowering.shared_input_linears.triton import launch_blocks, shared_input_linears_triton  # noqa: E402


def _inputs(tokens, rows, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(DEVICE, dtype)
    ws = [(torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE, dtype) for n in rows]
    return x, ws


def _rounding(dtype) -> float:
    """The largest relative error of one fp32 -> dtype cast: half a unit in the last place, a whole
    one for bf16 under the interpreter (it truncates bf16 casts; fp16 it rounds to nearest)."""
    eps = torch.finfo(dtype).eps
    return eps if DEVICE == "cpu" and dtype == torch.bfloat16 else eps / 2


def _assert_rounded_once(outs, x, ws):
    """Each output within a rounding step of the exact (fp32) sum, and of the reference's output."""
    assert len(outs) == len(ws)
    step = _rounding(x.dtype)
    for out, w, ref in zip(outs, ws, shared_input_linears_reference(x, ws), strict=True):
        exact = torch.nn.functional.linear(x.float(), w.float())
        assert out.dtype == x.dtype and out.shape == exact.shape and out.is_contiguous()
        scale = exact.abs().amax().item() + 1e-30
        # one rounding of the dtype, and fp32's order of summation (k terms)
        torch.testing.assert_close(out.float(), exact, rtol=step, atol=1e-5 * scale)
        # the reference rounds to nearest: half a unit from the exact sum
        torch.testing.assert_close(out.float(), ref.float(), rtol=step + torch.finfo(x.dtype).eps / 2, atol=1e-5 * scale)


@st.composite
def _cases(draw):
    return dict(
        tokens=draw(st.sampled_from([1, 2, 3, 4, 5, 9, 16])),
        rows=draw(st.lists(st.sampled_from([1, 2, 7, 32, 33, 130, 300]), min_size=1, max_size=4)),
        k=draw(st.sampled_from([16, 33, 200, 513, 1100])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(25), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    x, ws = _inputs(case["tokens"], case["rows"], case["k"], case["dtype"], case["seed"])
    _assert_rounded_once(shared_input_linears_triton(x, ws), x, ws)


@pytest.mark.parametrize("tokens,rows,k", [(1, [32, 32], 2048), (5, [256, 512, 512, 1], 256), (1, [72, 16, 8], 7168)])
def test_model_widths(tokens, rows, k):
    """Qwen 3.5's b / a at one token; its MoE block's four at five tokens (a narrower input);
    DeepSeek V3's input width (K 7168) at one token, fewer rows (the interpreter is slow)."""
    x, ws = _inputs(tokens, rows, k, torch.bfloat16, tokens + k)
    _assert_rounded_once(shared_input_linears_triton(x, ws), x, ws)


def test_a_strided_input_and_the_op():
    x, ws = _inputs(3, [5, 9], 40, torch.bfloat16, 3)
    wide = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 8:48] = x
    _assert_rounded_once(shared_input_linears_triton(wide[:, 8:48], ws), x, ws)
    _assert_rounded_once(torch.ops.fusion_passes.shared_input_linears(x, ws), x, ws)


def test_programs_spread_the_rows_over_the_gpu():
    # one token: ~256 programs over the rows, 1 to 8 rows each; a product tile of <= 8192 values
    assert launch_blocks(1, 64, 2048) == (1, 1, 1024)
    assert launch_blocks(1, 1281, 2048) == (1, 4, 1024)
    assert launch_blocks(1, 100_000, 7168) == (1, 8, 1024)
    assert launch_blocks(16, 1281, 2048) == (4, 8, 256)
    assert launch_blocks(3, 10, 40) == (4, 1, 64)


@pytest.mark.parametrize(
    "x_shape,w_shapes,dtypes,message",
    [((3, 16), [(8, 12)], (torch.bfloat16, torch.bfloat16), "weights \\[N, 16\\] expected"),
     ((3, 16), [(8, 16)], (torch.bfloat16, torch.float16), "of the input's dtype"),
     ((3, 16), [(8, 16)], (torch.float32, torch.float32), "a bf16 or fp16 input"),
     ((3, 16), [(8, 16)] * 5, (torch.bfloat16, torch.bfloat16), "1 to 4 weights"),
     ((3, 16), [], (torch.bfloat16, torch.bfloat16), "1 to 4 weights"),
     ((2, 3, 16), [(8, 16)], (torch.bfloat16, torch.bfloat16), "input \\[T, K\\] expected")],
)  # fmt: skip
def test_bad_arguments_get_one_line_errors(x_shape, w_shapes, dtypes, message):
    x = torch.zeros(x_shape, dtype=dtypes[0])
    ws = [torch.zeros(s, dtype=dtypes[1]) for s in w_shapes]
    with pytest.raises(ValueError, match=message):
        torch.ops.fusion_passes.shared_input_linears(x, ws)
    with pytest.raises(ValueError, match=message):
        shared_input_linears_triton(x.to(DEVICE), [w.to(DEVICE) for w in ws])


def test_opcheck():
    x, ws = _inputs(2, [3, 5], 16, torch.bfloat16, 1)
    torch.library.opcheck(torch.ops.fusion_passes.shared_input_linears.default, (x.cpu(), [w.cpu() for w in ws]))
