"""A user's fusion traced at every floating dtype, and backend()'s checks of its options."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import fusion_passes
from fusion_passes.fusion import FLOAT_DTYPES, pattern_pass
from fusion_passes.registry import get_fusions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


@pytest.fixture
def silu_mul_op():
    """my_project::silu_mul, defined by examples/custom_fusion.py (a custom op is defined once per
    process); the example's fusion of that name is set aside for the test and put back after."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import custom_fusion
    finally:
        sys.path.pop(0)
    fusion_passes.unregister_fusion("silu_mul")
    yield torch.ops.my_project.silu_mul.default
    fusion_passes.unregister_fusion("silu_mul")
    fusion_passes.register_fusion(  # as the example registers it
        "silu_mul",
        pattern=custom_fusion.silu_times_up,
        replacement=custom_fusion.fused_silu_mul,
        example_inputs=custom_fusion.example_inputs,
        check=custom_fusion.same_shape_and_dtype,
    )


def readme_snippet() -> str:
    """The custom-fusion code block of README.md ("Your own fusion"), as printed."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("Your own fusion") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int = 32, inner: int = 64) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)

    def forward(self, x):
        return F.silu(self.gate_proj(x)) * self.up_proj(x)


def test_readme_snippet_fuses_a_bf16_model(silu_mul_op):
    """The README's snippet, traced at fp32 by its example inputs, fuses the bf16 spelling too
    (F.silu upcasts to fp32 and back)."""
    exec(readme_snippet(), {"torch": torch, "F": F, "fusion_passes": fusion_passes})
    torch.manual_seed(0)
    model = GatedMLP().to(torch.bfloat16).eval()
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fusion_passes.backend(["silu_mul"], report=report))
    with torch.no_grad():
        out, expected = compiled(x), model(x)
    assert dict(report.matches) == {"silu_mul": 1}
    assert not report.rejected and not report.errors
    projections = {"aten.reshape.default": 4, "aten.permute.default": 2, "aten.mm.default": 2}
    silu_bf16 = {  # bf16 -> fp32, x / (1 + exp(-x)), -> bf16, * up
        "prims.convert_element_type.default": 2,
        "aten.neg.default": 1,
        "aten.exp.default": 1,
        "aten.add.Tensor": 1,
        "aten.div.Tensor": 1,
        "aten.mul.Tensor": 1,
    }
    assert dict(report.ops_before()) == {**projections, **silu_bf16}
    assert dict(report.ops_after()) == {**projections, "my_project.silu_mul.default": 1}
    torch.testing.assert_close(out, expected)


def matches_at(fusion, dtype: torch.dtype) -> int:
    """How many times the fusion's traced patterns rewrite F.silu(a) * b traced at ``dtype``."""
    args = [torch.randn(3, 8, dtype=dtype) for _ in range(2)]
    gm = make_fx(
        lambda a, b: F.silu(a) * b, decomposition_table=select_decomp_table(), tracing_mode="fake"
    )(*args)
    with detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]):
        return pattern_pass(fusion).apply(gm.graph)


def register_silu_mul(op, **kwargs):
    return fusion_passes.register_fusion(
        "silu_mul",
        pattern=lambda gate, up: F.silu(gate) * up,
        replacement=lambda gate, up: op(gate, up),
        example_inputs=lambda: [(torch.randn(4, 32), torch.randn(4, 32))],
        replace=True,
        **kwargs,
    )


def test_dtypes_decide_which_graphs_match(silu_mul_op):
    every = register_silu_mul(silu_mul_op)
    assert every.dtypes == FLOAT_DTYPES
    assert [matches_at(every, d) for d in FLOAT_DTYPES] == [1, 1, 1]
    fp32_only = register_silu_mul(silu_mul_op, dtypes=[torch.float32])
    assert [[a.dtype for a in e] for e in fp32_only.examples()] == [[torch.float32] * 2]
    assert [matches_at(fp32_only, d) for d in FLOAT_DTYPES] == [1, 0, 0]
    bf16_only = register_silu_mul(silu_mul_op, dtypes=[torch.bfloat16])
    # The matcher re-traces a candidate at its own dtype: a bf16 trace serves fp16 graphs (same
    # casts), never fp32 ones (no casts).
    assert [matches_at(bf16_only, d) for d in FLOAT_DTYPES] == [0, 1, 1]


def test_examples_cast_floating_tensors_once_per_dtype():
    def examples():
        x = torch.randn(4, 8)
        index = torch.arange(4)
        scale = torch.ones(1, dtype=torch.float8_e4m3fn)
        yield x, index, scale, 0.5
        yield x.bfloat16(), index, scale, 0.5  # the same variant once cast: traced once
        yield torch.randn(2, 4, 8), index, scale, 0.5  # another rank: its own variants

    fusion = fusion_passes.register_fusion(
        "cast_probe", pattern=lambda x, i, s, f: x, replacement=lambda x, i, s, f: x, example_inputs=examples
    )
    try:
        variants = fusion.examples()
        assert len(variants) == 2 * len(FLOAT_DTYPES)
        assert [v[0].dtype for v in variants] == list(FLOAT_DTYPES) * 2
        for x, index, scale, f in variants:  # integer, fp8 and scalar arguments as given
            assert index.dtype == torch.int64 and scale.dtype == torch.float8_e4m3fn and f == 0.5
        as_given = fusion_passes.register_fusion(
            "cast_probe",
            pattern=lambda x, i, s, f: x,
            replacement=lambda x, i, s, f: x,
            example_inputs=examples,
            dtypes=None,
            replace=True,
        )
        assert [v[0].dtype for v in as_given.examples()] == [torch.float32, torch.bfloat16, torch.float32]
        with pytest.raises(fusion_passes.FusionError, match="dtypes must be"):
            fusion_passes.register_fusion(
                "cast_probe", pattern=lambda x: x, replacement=lambda x: x, example_inputs=list,
                dtypes=[torch.int32], replace=True,
            )
    finally:
        fusion_passes.unregister_fusion("cast_probe")


def test_source_hash_changes_with_the_traced_dtypes(silu_mul_op):
    hashes = {
        register_silu_mul(silu_mul_op, dtypes=dtypes).source_hash()
        for dtypes in (FLOAT_DTYPES, [torch.float32], [torch.bfloat16], None)
    }
    assert len(hashes) == 4


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("max_autotune", "yes please", "Inductor option max_autotune must be bool, got str 'yes please'"),
        ("verify", "no", "verify must be a bool, got str 'no'"),
        ("strict", 1.5, "strict must be a bool, got float 1.5"),
        ("launch", 3, "launch must be a str ('direct' or 'dispatch'), got int 3"),
        ("fusions", 5, 'fusions must be "all" or a list of fusion names (str), got int 5'),
        ("fusions", ["rms_norm", 5], 'fusions must be "all" or a list of fusion names'),
        ("report", "r", "report must be a fusion_passes.Report or None, got str 'r'"),
        ("compile_threads", "4", "Inductor option compile_threads must be int | None, got str '4'"),
        ("triton.cudagraphs", 1, "Inductor option triton.cudagraphs must be bool, got int 1"),
    ],
)
def test_backend_rejects_an_option_of_the_wrong_type(option, value, message):
    with pytest.raises(TypeError) as error:
        fusion_passes.backend(**{option: value})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_backend_accepts_options_of_the_right_type():
    fusion_passes.backend(
        ["rms_norm"], report=fusion_passes.Report(), verify=True, strict=False, launch="dispatch",
        max_autotune=False, compile_threads=None, **{"triton.cudagraphs": False},
    )


def test_unknown_names_are_one_line_errors_with_close_names():
    with pytest.raises(fusion_passes.FusionError) as error:
        fusion_passes.backend(max_autotun=True)
    assert str(error.value).startswith("unknown Inductor option 'max_autotun'; did you mean 'max_autotune'")
    for request in (lambda: fusion_passes.backend(["add_rms_nrom"]), lambda: get_fusions(["add_rms_nrom"])):
        with pytest.raises(fusion_passes.FusionError) as error:
            request()
        assert str(error.value).startswith("unknown fusion 'add_rms_nrom'; did you mean 'add_rms_norm'")
        assert "\n" not in str(error.value)
    with pytest.raises(fusion_passes.FusionError, match="unknown fusion 'zzz'; registered: add_rms_norm, "):
        get_fusions("zzz")


def test_all_among_names_adds_the_defaults():
    defaults = [f.name for f in get_fusions("all")]
    both = [f.name for f in get_fusions(["all", "allreduce_add_rms_norm"])]
    assert "allreduce_add_rms_norm" not in defaults
    assert set(both) == set(defaults) | {"allreduce_add_rms_norm"}
    order = [f.name for f in get_fusions([*defaults, "allreduce_add_rms_norm"])]
    assert both == order  # registry (application) order, as for names alone
    with pytest.raises(fusion_passes.FusionError, match="unknown fusion 'zzz'"):
        get_fusions(["all", "zzz"])


def test_freezing_is_named_as_the_reason_parameter_math_does_not_match():
    """Inductor's freezing folds a parameter's math (Qwen 3.5's -exp(A_log)) into a constant before
    the fusions run: the compile says so once, in one line; without freezing it says nothing."""
    import warnings

    from fusion_passes.backend import FREEZING_WARNING

    class Decay(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a_log = torch.nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return x * -self.a_log.float().exp()

    x = torch.randn(2, 4)
    for freezing in (True, False):
        torch._dynamo.reset()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = torch.compile(Decay(), backend=fusion_passes.backend(["rms_norm"], freezing=freezing))(x)
        said = [str(w.message) for w in caught if "freezing" in str(w.message)]
        assert said == ([FREEZING_WARNING] if freezing else []), said
        torch.testing.assert_close(out, -x)
