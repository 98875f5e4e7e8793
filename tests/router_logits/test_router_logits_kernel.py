"""router_logits' Triton kernel against its plain-torch reference (F.linear of the upcast inputs):
several token counts (one to past a program's four), expert counts that are not powers of two,
hidden sizes that do not fill a block, strided hidden states, bf16 / fp16; on CPU tensors through
Triton's interpreter, or on CUDA tensors, compiled, where a GPU is present. The sums run in
another order than the reference's: fp32's tolerance, relative to the row's size."""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Chosen before triton is first imported; only without a GPU (see test_rms_norm_kernel.py).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import fusion_passes  # noqa: E402,F401  (registers torch.ops.fusion_passes)
from fusion_passes.lowering.router_logits.reference import router_logits_reference  # noqa: E402
from fusion_passes.lowering.router_logits.triton import router_logits_triton  # noqa: E402


def _inputs(tokens, experts, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    w = (torch.randn(experts, hidden, generator=g) * 0.05).to(DEVICE, dtype)
    return x, w


def _assert_close(out, expected):
    assert out.dtype == torch.float32 and out.shape == expected.shape
    # exact products, fp32 sums of up to H terms in another order
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("tokens,experts,hidden", [(1, 256, 700), (3, 10, 33), (4, 64, 256), (9, 72, 513), (64, 16, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(tokens, experts, hidden, dtype):
    x, w = _inputs(tokens, experts, hidden, dtype, tokens * experts)
    _assert_close(router_logits_triton(x, w), router_logits_reference(x, w))


def test_strided_hidden_states_and_the_op():
    x, w = _inputs(5, 12, 40, torch.bfloat16, 3)
    wide = torch.zeros(5, 64, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 8:48] = x
    expected = router_logits_reference(x, w)
    _assert_close(router_logits_triton(wide[:, 8:48], w), expected)
    _assert_close(torch.ops.fusion_passes.router_logits(x, w), expected)


@pytest.mark.parametrize(
    "x_shape,w_shape,dtypes,message",
    [((3, 16), (8, 12), (torch.bfloat16, torch.bfloat16), "hidden size 16 against the weight's 12"),
     ((3, 16), (8, 16), (torch.bfloat16, torch.float16), "of one dtype expected"),
     ((3, 16), (8, 16), (torch.float32, torch.float32), "of one dtype expected"),
     ((2, 3, 16), (8, 16), (torch.bfloat16, torch.bfloat16), "hidden states \\[T, H\\] and weight \\[E, H\\]")],
)  # fmt: skip
def test_bad_arguments_get_one_line_errors(x_shape, w_shape, dtypes, message):
    x, w = torch.zeros(x_shape, dtype=dtypes[0]), torch.zeros(w_shape, dtype=dtypes[1])
    with pytest.raises(ValueError, match=message):
        torch.ops.fusion_passes.router_logits(x, w)
    with pytest.raises(ValueError, match=message):
        router_logits_triton(x.to(DEVICE), w.to(DEVICE))


def test_opcheck():
    x, w = _inputs(3, 8, 16, torch.bfloat16, 1)
    torch.library.opcheck(torch.ops.fusion_passes.router_logits.default, (x, w))
