"""Gated DeltaNet's prefill as transformers writes it (``torch_chunk_gated_delta_rule`` of
qwen3_5 / qwen3_next, imported from transformers itself): one fused op per call, whatever the
chunk count (the patterns are traced per chunk count read off the graph), padded or whole chunks,
from a cached state or from none, with or without the final state; on the CPU, where the op runs
its reference, bit-equal to eager. Not fused, and reported as near misses: another chunk size, a
rule without the q / k l2norm."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next

import fusion_passes
from fusion_passes.lowering.chunk_gated_delta_rule import op as chunk_op

FUSION = ["chunk_gated_delta_rule"]
SOLVE, FUSED = "aten.linalg_solve_triangular.default", "fusion_passes.chunk_gated_delta_rule.default"


def _inputs(tokens, dtype, batch=2, heads=3, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, tokens, heads, dk, generator=gen).to(dtype),
        torch.randn(batch, tokens, heads, dk, generator=gen).to(dtype),
        torch.randn(batch, tokens, heads, dv, generator=gen).to(dtype),
        -torch.rand(batch, tokens, heads, generator=gen),  # fp32, as transformers' gating gives
        torch.rand(batch, tokens, heads, generator=gen).to(dtype),
        torch.randn(batch, heads, dk, dv, generator=gen) * 0.1,
    )


def _prefill_from_state(rule):
    def prefill(q, k, v, g, beta, state):  # a chunked prefill continuing a cached sequence
        return rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    return prefill


def _prefill_new(rule):
    def prefill(q, k, v, g, beta):  # a first prefill into a cache: no state yet
        return rule(
            q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    return prefill


def _forward_without_cache(rule):
    def forward(q, k, v, g, beta):  # use_cache=False: the final state is dropped
        return rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )[0]

    return forward


def _compile(fn, args, fusions=FUSION):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(
        fn, backend=fusion_passes.backend(fusions, report=report, strict=True), fullgraph=True
    )
    with torch.no_grad():
        out = compiled(*args)
    return (out if isinstance(out, tuple) else (out,)), report


RULES = {
    "qwen3_5": modeling_qwen3_5.torch_chunk_gated_delta_rule,
    "qwen3_next": modeling_qwen3_next.torch_chunk_gated_delta_rule,
}
FORMS = {
    "from_state": (_prefill_from_state, 6),
    "new": (_prefill_new, 5),
    "no_cache": (_forward_without_cache, 5),
}


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "model, tokens, dtype, form",
    [
        *(("qwen3_5", 100, torch.bfloat16, form) for form in FORMS),  # two chunks, the second padded
        ("qwen3_5", 128, torch.bfloat16, "new"),  # whole chunks: no pad, no slice
        ("qwen3_next", 5, torch.float16, "from_state"),  # one padded chunk
        ("qwen3_5", 200, torch.float32, "no_cache"),  # four chunks
        # the other forms of the last three: the full suite
        *(pytest.param("qwen3_5", 128, torch.bfloat16, f, marks=SLOW) for f in FORMS if f != "new"),
        *(pytest.param("qwen3_next", 5, torch.float16, f, marks=SLOW) for f in FORMS if f != "from_state"),
        *(pytest.param("qwen3_5", 200, torch.float32, f, marks=SLOW) for f in FORMS if f != "no_cache"),
    ],
)
def test_transformers_chunked_rule_fuses(model, tokens, dtype, form):
    make, nargs = FORMS[form]
    fn = make(RULES[model])
    args = _inputs(tokens, dtype)[:nargs]
    out, report = _compile(fn, args)
    with torch.no_grad():
        expected = fn(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert report.final()["chunk_gated_delta_rule"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert before[SOLVE] == 2 and after[SOLVE] == 0 and before["aten.bmm.default"] >= 4
    assert after[FUSED] == 1 and after["aten.bmm.default"] == 0
    assert len(out) == len(expected) and all(torch.equal(a, e) for a, e in zip(out, expected, strict=True))


def _export_path(monkeypatch):
    """transformers' export path of the rule (the UT system inverted by forward substitution), the
    one torch.compile takes under torch <= 2.11, whose Dynamo reads torch.compiler.is_exporting()
    as True inside any compile."""
    for module in (modeling_qwen3_5, modeling_qwen3_next):
        monkeypatch.setattr(module, "is_torchdynamo_exporting", lambda: True)


@pytest.mark.parametrize(
    "model, tokens, dtype, form",
    [
        ("qwen3_5", 100, torch.bfloat16, "from_state"),
        ("qwen3_next", 64, torch.float16, "no_cache"),
        pytest.param("qwen3_5", 130, torch.float32, "from_state", marks=SLOW),
        pytest.param("qwen3_5", 100, torch.bfloat16, "no_cache", marks=SLOW),
        pytest.param("qwen3_next", 64, torch.float16, "from_state", marks=SLOW),
        pytest.param("qwen3_5", 130, torch.float32, "no_cache", marks=SLOW),
    ],
)
def test_forward_substitution_rule_fuses(monkeypatch, model, tokens, dtype, form):
    make, nargs = FORMS[form]
    fn = make(RULES[model])
    args = _inputs(tokens, dtype)[:nargs]
    with monkeypatch.context() as patched:
        _export_path(patched)
        out, report = _compile(fn, args)
    with torch.no_grad():
        expected = fn(*args)  # eager, outside export: the triangular solve the op's reference rounds as
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert report.final()["chunk_gated_delta_rule"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert SOLVE not in before and before["aten.bmm.default"] >= 6 and before["aten.slice_scatter.default"] >= 63
    assert after[FUSED] == 1 and after["aten.bmm.default"] == 0 and "aten.slice_scatter.default" not in after
    assert len(out) == len(expected) and all(torch.equal(a, e) for a, e in zip(out, expected, strict=True))


def test_two_prompt_lengths_in_one_graph_fuse_both():
    rule = RULES["qwen3_5"]

    def two(q1, k1, v1, g1, b1, q2, k2, v2, g2, b2):
        out1, _ = rule(q1, k1, v1, g=g1, beta=b1, output_final_state=False, use_qk_l2norm_in_kernel=True)
        out2, _ = rule(q2, k2, v2, g=g2, beta=b2, output_final_state=False, use_qk_l2norm_in_kernel=True)
        return out1, out2

    args = (*_inputs(70, torch.bfloat16)[:5], *_inputs(300, torch.bfloat16, seed=1)[:5])
    out, report = _compile(two, args)
    with torch.no_grad():
        expected = two(*args)
    assert report.final()["chunk_gated_delta_rule"] == 2
    assert (report.ops_before()[SOLVE], report.ops_after()[SOLVE]) == (4, 0)
    assert (report.ops_before()[FUSED], report.ops_after()[FUSED]) == (0, 2)
    assert all(torch.equal(a, e) for a, e in zip(out, expected, strict=True))


@pytest.mark.parametrize(
    "kwargs, why",
    [
        pytest.param({"chunk_size": 32, "use_qk_l2norm_in_kernel": True}, "another chunk size", marks=SLOW),
        ({"use_qk_l2norm_in_kernel": False}, "no l2norm in the rule"),
    ],
)
def test_other_rules_are_near_misses(kwargs, why):
    rule = RULES["qwen3_5"]

    def prefill(q, k, v, g, beta, state):
        return rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, **kwargs)

    args = _inputs(100, torch.bfloat16)
    out, report = _compile(prefill, args)
    assert report.final()["chunk_gated_delta_rule"] == 0, why
    assert report.ops_after() == report.ops_before() and report.ops_after()[SOLVE] == 2
    assert report.ops_after()[FUSED] == 0
    assert [m.fusion for m in report.near_misses] == ["chunk_gated_delta_rule"]  # one per rule: its chunk cumsum
    with torch.no_grad():
        stock = torch.compile(prefill, backend="inductor")(*args)
    assert all(torch.equal(a, s) for a, s in zip(out, stock, strict=True))


def test_cuda_sites_need_the_chunk_kernel(monkeypatch):
    q, _, v, *_ = _inputs(70, torch.bfloat16)
    monkeypatch.setattr(chunk_op, "fla_chunk_kernel", lambda: None)
    assert "flash-linear-attention" in chunk_op.fla_chunk_kernel_refusal(q, v, 1e-6)
    monkeypatch.setattr(chunk_op, "fla_chunk_kernel", lambda: object())
    assert chunk_op.fla_chunk_kernel_refusal(q, v, 1e-6) is None
    assert "not fp32" in chunk_op.fla_chunk_kernel_refusal(q.float(), v.float(), 1e-6)
    assert "exceed" in chunk_op.fla_chunk_kernel_refusal(torch.zeros(1, 2, 1, 512, dtype=q.dtype), v, 1e-6)
    assert "eps" in chunk_op.fla_chunk_kernel_refusal(q, v, 1e-5)


@pytest.mark.slow
def test_dynamic_prompt_length_is_left_to_inductor_and_reported():
    """A prompt length torch.compile made dynamic (symbolic sizes; the chunk count stays guarded):
    no pattern is traced for it (each tensor's size reads feed sym_size nodes, extra users no traced
    pattern has), the rule stays Inductor's, correct, and is a near miss."""
    fn = _prefill_new(RULES["qwen3_5"])
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusion_passes.backend(FUSION, report=report, strict=True),
                             fullgraph=True, dynamic=True)  # fmt: skip
    args = _inputs(100, torch.bfloat16)[:5]
    with torch.no_grad():
        out, expected = compiled(*args), fn(*args)
    assert report.final()["chunk_gated_delta_rule"] == 0
    assert report.ops_after() == report.ops_before() and report.ops_after()[SOLVE] == 2
    assert report.ops_after()[FUSED] == 0
    assert [m.fusion for m in report.near_misses] == ["chunk_gated_delta_rule"]
    for a, e in zip(out, expected, strict=True):  # Inductor's own code: its summation order
        torch.testing.assert_close(a, e)
