"""The index-mask kernel against its plain-torch reference and against what transformers computes
(top-k, then a scatter into a mask of ones): rows with ties at the k-th place, -inf (unfilled
cache positions), NaN and both zeros, odd lengths, k from 1 to T, fp32 / bf16 / fp16; on CPU tensors
through Triton's interpreter, or on CUDA tensors, compiled, where a GPU is present."""

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
from fusion_passes.lowering.sparse_index_mask.reference import sparse_index_mask_reference  # noqa: E402
from fusion_passes.lowering.sparse_index_mask.triton import sparse_index_mask_triton  # noqa: E402


def _transformers_mask(scores, k):
    idx = scores.topk(k, dim=-1).indices.to(torch.int32)
    return torch.ones(scores.shape, dtype=torch.bool, device=scores.device).scatter(-1, idx.long(), False)


@st.composite
def _cases(draw):
    t = draw(st.sampled_from([1, 2, 7, 16, 37, 130, 1025, 3000]))
    return dict(
        rows=draw(st.sampled_from([(1,), (3,), (2, 3)])),
        t=t,
        k=draw(st.integers(1, t)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        ties=draw(st.booleans()),
        unfilled=draw(st.integers(0, 5)),
        lowest=draw(st.booleans()),  # the lowest-key shortcut (on by default above LOWEST_ROWS rows)
        radix=draw(st.sampled_from([5, 3, 6, 8])),  # bits a pass (the launcher's 5; others for A/B)
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    g = torch.Generator().manual_seed(case["seed"])
    scores = torch.randn(*case["rows"], case["t"], generator=g)
    if case["ties"]:  # relu'd index scores: many exact zeros, and repeated values
        scores = scores.clamp_min(0).round(decimals=1)
    if case["unfilled"]:
        scores[..., -case["unfilled"]:] = float("-inf")
    scores = scores.to(DEVICE, case["dtype"])
    mask = sparse_index_mask_triton(scores, case["k"], lowest=case["lowest"], radix=case["radix"])
    assert mask.dtype == torch.bool and mask.shape == scores.shape
    assert torch.equal(mask, sparse_index_mask_reference(scores, case["k"]))
    assert bool((~mask).sum(-1).eq(case["k"]).all())


@pytest.mark.parametrize("lowest", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefills_causal_rows(dtype, lowest):
    """A prefill's index scores: row i scores positions 0..i, the rest -inf (the causal mask before
    the top-k). Rows with at most k finite scores keep them all and the lowest -inf positions after
    them (the first pass finds the k-th at the lowest key; with ``lowest``, the shortcut ends the
    row's selection there); later rows select; all as the reference."""
    t, k = 96, 40
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(t, t, generator=g).clamp_min(0).round(decimals=1)  # relu'd: ties and zeros
    scores = scores.masked_fill(torch.arange(t)[None, :] > torch.arange(t)[:, None], float("-inf"))
    rows = [0, 1, k - 2, k - 1, k, t - 1]  # around the k-th row (the interpreter runs a program a row)
    scores = scores[rows].to(DEVICE, dtype)
    mask = sparse_index_mask_triton(scores, k, lowest=lowest)
    assert torch.equal(mask, sparse_index_mask_reference(scores, k))
    assert bool((~mask).sum(-1).eq(k).all())
    assert not mask[:4, :k].any() and mask[:4, k:].all()  # rows up to k - 1: the first k positions


@pytest.mark.parametrize("t,k", [(37, 5), (1040, 64), (2060, 2048)])
def test_without_ties_equals_the_models_top_k_and_scatter(t, k):
    g = torch.Generator().manual_seed(t)
    scores = torch.randperm(3 * t, generator=g).float().view(3, t).to(DEVICE)  # distinct
    scores[:, -3:] = float("-inf")  # unfilled positions, fewer than T - k: no tie at the k-th place
    assert torch.equal(sparse_index_mask_triton(scores, k), _transformers_mask(scores, k))


@pytest.mark.parametrize("radix", [0, 9])
def test_a_digit_width_outside_one_to_eight_bits_is_refused(radix):
    with pytest.raises(ValueError, match="radix must be in 1..8"):
        sparse_index_mask_triton(torch.zeros(1, 5, device=DEVICE), 2, radix=radix)


def test_nan_above_inf_and_negative_zero_below_zero():
    scores = torch.tensor([[0.0, -0.0, float("inf"), float("nan"), 1.0, -0.0, 0.0]], device=DEVICE)
    expected = {1: [3], 2: [2, 3], 3: [2, 3, 4], 4: [0, 2, 3, 4], 5: [0, 2, 3, 4, 6], 6: [0, 1, 2, 3, 4, 6]}
    for k, kept in expected.items():
        mask = sparse_index_mask_triton(scores, k)
        assert torch.equal(mask, sparse_index_mask_reference(scores, k))
        assert (~mask[0]).nonzero().flatten().tolist() == kept


@pytest.mark.parametrize(
    "scores,k,message",
    [(torch.zeros(2, 5), 0, "k must be in"), (torch.zeros(2, 5), 6, "k must be in"),
     (torch.zeros(2, 5, dtype=torch.int32), 2, "fp32, bf16 or fp16"), (torch.zeros(2, 0), 1, "T >= 1")],
)  # fmt: skip
def test_bad_arguments_get_one_line_errors(scores, k, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.fusion_passes.sparse_index_mask(scores, k)
    with pytest.raises(ValueError, match=message):
        sparse_index_mask_triton(scores.to(DEVICE), k)


@pytest.mark.parametrize("rows,t,split", [(1, 8208, 33), (1, 16400, 65), (8, 8208, 16), (64, 8208, 2), (128, 8208, 1),
                                          (1, 256, 1), (1, 257, 2), (200, 4112, 1)])  # fmt: skip
def test_programs_a_row_fill_the_sms_without_exceeding_them(monkeypatch, rows, t, split):
    """About 256 positions a program, and all of a launch's programs on the GPU at once (132 SMs:
    an H200); a row's programs wait for each other, so more would never finish."""
    from types import SimpleNamespace

    from fusion_passes.lowering.sparse_index_mask import triton as mask_triton

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    assert mask_triton._split(rows, t, torch.device("cuda")) == split
    assert rows * split <= 132 or split == 1
    assert mask_triton._split(rows, t, torch.device("cpu")) == 1


def test_a_split_that_could_not_finish_is_refused():
    with pytest.raises(ValueError, match="split must be >= 1, got 0"):
        sparse_index_mask_triton(torch.zeros(2, 5, device=DEVICE), 2, split=0)
    with pytest.raises(ValueError, match="shortcut takes unsplit rows"):
        sparse_index_mask_triton(torch.zeros(2, 500, device=DEVICE), 2, split=2, lowest=True)
    if DEVICE == "cpu":  # the interpreter runs one program at a time: a row's parts would wait forever
        with pytest.raises(ValueError, match="split > 1 needs a GPU"):
            sparse_index_mask_triton(torch.zeros(2, 500), 2, split=2)
    else:  # more programs than SMs: some would wait for programs that cannot start
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        with pytest.raises(ValueError, match="programs a row exceed the GPU's"):
            sparse_index_mask_triton(torch.zeros(sms, 500, device=DEVICE), 2, split=2)


def test_opcheck():
    scores = torch.randn(2, 3, 19, device=DEVICE)
    torch.library.opcheck(torch.ops.fusion_passes.sparse_index_mask.default, (scores, 4))


@pytest.mark.parametrize("fill", [float("-inf"), -65504.0])  # SDPA's bias of a closed key; cuDNN's
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,s,t,k", [(2, 1, 130, 16), (1, 3, 1025, 1000), (3, 2, 37, 36)])
def test_the_additive_attention_mask_equals_the_models(b, s, t, k, dtype, ties, fill):
    """sparse_attention_mask: the same kernel's last pass writing SDPA's additive mask of
    attention_mask & ~index_mask (a causal mask broadcast over the batch, as sdpa_mask gives it),
    against the reference and against the model's statements (top-k, scatter, &, where)."""
    from fusion_passes.lowering.sparse_index_mask.reference import sparse_attention_mask_reference

    g = torch.Generator().manual_seed(b * t + s)
    scores = torch.randn(b, s, t, generator=g)
    if ties:
        scores = scores.clamp_min(0).round(decimals=1)
    position = t - s + torch.arange(s)
    causal = torch.arange(t)[None, :] <= position[:, None]
    scores = scores.masked_fill(~causal, float("-inf")).to(DEVICE)
    attention_mask = causal[None, None].expand(b, 1, s, t).to(DEVICE)
    out = sparse_index_mask_triton(scores, k, attention_mask, dtype, fill)
    expected = sparse_attention_mask_reference(scores, k, attention_mask, dtype, fill)
    assert out.dtype == dtype and out.shape == (b, 1, s, t) and torch.equal(out, expected)
    if not ties:  # no tie at the k-th place: every order of equal scores keeps the same set
        keep = attention_mask & ~_transformers_mask(scores, k).unsqueeze(1)
        # SDPA's conversion, as its C++ writes it (cuDNN's with -65504, rounded to bf16's -65536)
        model = torch.where(keep.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype, device=DEVICE))
        assert model.dtype == dtype and torch.equal(out, model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,s,t,k,first", [(2, 1, 130, 16, 129), (1, 3, 1025, 1000, 1010), (3, 2, 37, 36, 20), (1, 1, 64, 8, 0)])
def test_the_causal_attention_mask_from_the_first_position_equals_the_read_one(b, s, t, k, first, dtype):
    """sparse_attention_mask with causal_first: the causal mask compared in the kernel equals the
    op given transformers' mask (built as sdpa_mask builds it from the cache position), bit for
    bit, and the reference; the first position may leave positions past the step's tokens closed."""
    from fusion_passes.lowering.sparse_index_mask.reference import sparse_attention_mask_reference

    g = torch.Generator().manual_seed(b * t + s + first)
    scores = torch.randn(b, s, t, generator=g).to(DEVICE)
    first_position = torch.tensor(first, device=DEVICE)  # the step's cache_position[0]
    kv_idx = torch.arange(t, device=DEVICE)[None, None, None, :]
    q_idx = (torch.arange(s, device=DEVICE) + first_position)[None, None, :, None]
    attention_mask = (kv_idx <= q_idx).expand(b, -1, s, t)
    for fill in (float("-inf"), -65504.0):
        out = sparse_index_mask_triton(scores, k, None, dtype, fill, causal_first=first_position)
        read = sparse_index_mask_triton(scores, k, attention_mask, dtype, fill)
        expected = sparse_attention_mask_reference(scores, k, None, dtype, fill, first_position)
        assert out.shape == (b, 1, s, t) and torch.equal(out, read) and torch.equal(out, expected)
        assert torch.equal(expected, sparse_attention_mask_reference(scores, k, attention_mask, dtype, fill))


def test_the_mask_and_the_causal_first_position_are_one_or_the_other():
    scores, first = torch.randn(2, 1, 40), torch.tensor(39)
    ok = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    for mask, position, message in ((ok, first, "one of them"), (None, None, "one of them"),
                                    (None, torch.tensor([1.0]), "must be one int tensor"),
                                    (None, torch.tensor([3, 4]), "must be one int tensor")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            torch.ops.fusion_passes.sparse_attention_mask(scores, 8, mask, torch.bfloat16, -1.0, position)


def test_an_attention_mask_of_another_shape_gets_a_one_line_error():
    scores = torch.randn(2, 1, 40)
    ok = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    for mask, dtype, fill, message in ((torch.ones(2, 1, 40, dtype=torch.bool), torch.bfloat16, -1.0, "must be bool \\[2, 1, 1, 40\\]"),
                                       (torch.ones(2, 1, 1, 40), torch.bfloat16, -1.0, "must be bool"),
                                       (ok, torch.int8, -1.0, "dtype torch.int8"),
                                       (ok, torch.bfloat16, 0.0, "fill 0.0 must be negative")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            torch.ops.fusion_passes.sparse_attention_mask(scores, 8, mask, dtype, fill)


def test_the_bias_is_rounded_as_torch_rounds_a_constant_of_the_dtype():
    """The launcher rounds the bias in plain Python (it is traced under fake tensors): equal to
    torch.full's value in each dtype for random negative values over the dtypes' whole range."""
    from fusion_passes.lowering.sparse_index_mask.triton import _rounded_to

    g = torch.Generator().manual_seed(0)
    values = [-65504.0, -65520.0, float("-inf")] + (-(10.0 ** (torch.rand(500, generator=g) * 80 - 42))).tolist()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for v in values:
            try:
                want = torch.full((), v, dtype=dtype).item()
            except RuntimeError:  # beyond the dtype's range: torch refuses the constant
                continue
            assert _rounded_to(v, dtype) == want, (v, dtype)
