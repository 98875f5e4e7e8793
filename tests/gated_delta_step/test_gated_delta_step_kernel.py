"""The Gated DeltaNet decode-step kernel against its plain-torch reference: on CPU tensors through
Triton's interpreter, or on CUDA tensors, compiled, where a GPU is present."""

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
from fusion_passes.lowering.gated_delta_step.reference import gated_delta_step_reference  # noqa: E402
from fusion_passes.lowering.gated_delta_step.triton import gated_delta_step_triton  # noqa: E402

# (rtol, atol) in float64. The state and every sum are fp32 in both: the sums' order differs
# (seen ~4 fp32 eps relative on the state). The output is rounded once to v.dtype; bf16 on the
# interpreter also truncates sigmoid(b)'s rounding, which moves the state by up to one bf16 ulp
# of beta (2^-8 relative of the update): seen 1e-2 absolute on unit-normal states of K = 128.
TOLERANCE = {
    torch.float32: ((1e-5, 1e-5), (1e-5, 1e-5)),
    torch.float16: ((2e-3, 2e-3), (2e-3, 2e-3)),
    torch.bfloat16: ((1.6e-2, 1.6e-2), (2e-2, 2e-2)),
}


def _inputs(bsz, hk, hv, dk, dv, dtype, param_dtype, g, strided=False):
    def randn(*shape, dt=dtype):
        return torch.randn(shape, generator=g).to(DEVICE, dt)

    if strided:  # q, k, v as the model hands them: per-head views of one [B, 1, 2 Hk K + HV V] row
        row = randn(bsz, 1, 2 * hk * dk + hv * dv + 3)
        q = row[..., : hk * dk].unflatten(-1, (hk, dk))
        k = row[..., hk * dk : 2 * hk * dk].unflatten(-1, (hk, dk))
        v = row[..., 2 * hk * dk : 2 * hk * dk + hv * dv].unflatten(-1, (hv, dv))
    else:
        q, k, v = randn(bsz, 1, hk, dk), randn(bsz, 1, hk, dk), randn(bsz, 1, hv, dv)
    a, b = randn(bsz, 1, hv), randn(bsz, 1, hv)
    A_log = (torch.rand(hv, generator=g) * 16 + 0.01).log().to(DEVICE, param_dtype)
    dt_bias = randn(hv, dt=param_dtype)
    state = randn(bsz, hv, dk, dv, dt=torch.float32)
    return q, k, v, a, b, A_log, dt_bias, state


def _check(args, form, in_place=False):
    q, k, v, a, b, A_log, dt_bias, state = args
    expected, expected_state = gated_delta_step_reference(*args, *form)
    before = state.clone()
    wrap = (lambda kernel: kernel) if in_place else None
    out, new_state = gated_delta_step_triton(*args, *form, wrap=wrap)
    (rtol, atol), (state_rtol, state_atol) = TOLERANCE[v.dtype]
    assert out.dtype == v.dtype and out.shape == v.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(new_state.double(), expected_state.double(), rtol=state_rtol, atol=state_atol)
    if in_place:  # the launch Inductor inlines updates the cache's state itself
        assert new_state.data_ptr() == state.data_ptr()
    else:  # the dispatcher's call is functional: the input state is untouched
        assert torch.equal(state, before) and new_state.data_ptr() != state.data_ptr()


@st.composite
def _cases(draw):
    hk = draw(st.integers(1, 4))
    return dict(
        bsz=draw(st.integers(1, 5)),
        hk=hk,
        hv=hk * draw(st.sampled_from([1, 2, 3])),
        dk=draw(st.sampled_from([8, 16, 20, 32])),
        dv=draw(st.sampled_from([8, 24, 32, 40])),
        dtype=draw(st.sampled_from(list(TOLERANCE))),
        fp32_params=draw(st.booleans()),
        divide_scale=draw(st.booleans()),
        qk_l2norm=draw(st.booleans()),
        in_place=draw(st.booleans()),
        strided=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    g = torch.Generator().manual_seed(case["seed"])
    dtype = case["dtype"]
    param_dtype = torch.float32 if case["fp32_params"] else dtype
    args = _inputs(case["bsz"], case["hk"], case["hv"], case["dk"], case["dv"], dtype, param_dtype, g,
                   case["strided"])  # fmt: skip
    scale = case["dk"] ** 0.5 if case["divide_scale"] else case["dk"] ** -0.5
    _check(args, (scale, case["divide_scale"], case["qk_l2norm"], 1e-6), case["in_place"])


@pytest.mark.parametrize("bsz", [1, 3])
def test_qwen_widths_bf16(bsz):
    """Qwen3-Next / Qwen 3.5's GDN: 16 key heads, 32 value heads of 128, as transformers calls it."""
    g = torch.Generator().manual_seed(bsz)
    args = _inputs(bsz, 16, 32, 128, 128, torch.bfloat16, torch.bfloat16, g, strided=True)
    _check(args, (128**0.5, True, True, 1e-6), in_place=True)


def test_outputs_fully_written(monkeypatch):
    """An output allocated NaN-filled comes back NaN-free: every element was stored."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    g = torch.Generator().manual_seed(0)
    args = _inputs(3, 2, 6, 20, 40, torch.float16, torch.float16, g)
    _check(args, (20**0.5, True, True, 1e-6))


def test_op_is_functional_and_checked():
    g = torch.Generator().manual_seed(2)
    args = _inputs(2, 2, 4, 16, 8, torch.float32, torch.float32, g)
    form = (4.0, True, True, 1e-6)
    torch.library.opcheck(torch.ops.fusion_passes.gated_delta_step.default, (*args, *form))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.__setitem__(7, a[7].bfloat16()), "float32"),  # a bf16 state
        (lambda a: a.__setitem__(2, a[2][:, :, :3]), "not a multiple"),  # 3 value heads, 2 key heads
        (lambda a: [a.__setitem__(i, a[i].expand(2, 2, -1, -1)) for i in range(3)], "one token"),
        (lambda a: a.__setitem__(5, a[5][:2]), "A_log"),
    ],
)
def test_bad_arguments_raise(change, message):
    g = torch.Generator().manual_seed(3)
    args = list(_inputs(2, 2, 4, 16, 8, torch.float32, torch.float32, g))
    change(args)
    with pytest.raises(ValueError, match=message):
        gated_delta_step_triton(*args, 4.0, True, True, 1e-6)


@pytest.mark.parametrize(
    "bsz,hk,hv,dk,dv,block_v,programs,stages",
    [(2, 2, 4, 16, 32, 8, 5, 2), (3, 1, 3, 24, 20, 16, 4, 1), (1, 2, 2, 16, 16, 16, 64, 2)],
    ids=["fewer_programs_than_tiles", "odd_sizes", "more_programs_than_tiles"],
)
def test_persistent_form_is_the_grid_kernel(bsz, hk, hv, dk, dv, block_v, programs, stages):
    """The persistent launch (a fixed grid walking the tiles) computes each tile as the grid kernel
    does: out and state bit-equal, whatever the programs (fewer than the tiles, or more)."""
    g = torch.Generator().manual_seed(bsz * 31 + dv)
    args = _inputs(bsz, hk, hv, dk, dv, torch.bfloat16, torch.float32, g)
    form = (dk**0.5, True, True, 1e-6)
    grid = gated_delta_step_triton(*args, *form, block_v=block_v, num_warps=1)
    persistent = gated_delta_step_triton(*args, *form, block_v=block_v, num_warps=1, programs=programs, stages=stages)
    assert torch.equal(grid[0], persistent[0]) and torch.equal(grid[1], persistent[1])
    expected, expected_state = gated_delta_step_reference(*args, *form)
    (rtol, atol), (state_rtol, state_atol) = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(persistent[0].double(), expected.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(persistent[1].double(), expected_state.double(), rtol=state_rtol, atol=state_atol)
