"""The fusion-passes CLI: list, diff on a user factory (text + JSON), and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jsonschema
import pytest
import torch

from fusion_passes.cli import main
from fusion_passes.report_schema import DIFF_REPORT_SCHEMA

FACTORY = textwrap.dedent(
    """
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(64, eps=1e-6)

        def forward(self, x, residual):
            return self.norm(x + residual)

    def make():
        return Block(), (torch.randn(2, 5, 64), torch.randn(2, 5, 64))

    def broken():
        raise RuntimeError("no weights here")

    class Branchy(torch.nn.Module):
        def forward(self, x, residual):
            if (x + residual).sum().item() > 0:  # data-dependent: a graph break
                return x
            return residual

    class BrokenNorms(torch.nn.Module):
        # Three RMSNorm look-alikes that must stay unfused, each for its own reason.

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64), requires_grad=False)

        def forward(self, x, residual):
            h = x.float()
            a = h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6)  # over the wrong dim
            b = h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + 1e-6)  # a sum-based L2 norm
            c = h * torch.rsqrt(h.abs().mean(-1, keepdim=True) + 1e-6)  # |x| instead of x^2
            return (self.w * a.to(x.dtype)) + (self.w * b.to(x.dtype)) + (self.w * c.to(x.dtype))

    def broken_norms():
        return BrokenNorms(), (torch.randn(2, 8, 64), torch.randn(2, 8, 64))

    def breaks():
        return Branchy(), (torch.randn(2, 64), torch.randn(2, 64))

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(32, eps=1e-6)

        def forward(self, x):
            return self.norm(x)

    def bf16_one_tensor():  # a bf16 model and its one input as a bare tensor
        return Norm().to(torch.bfloat16), torch.randn(3, 32, dtype=torch.bfloat16)

    def bare():
        return Norm()

    def triple():
        return Norm(), (torch.randn(3, 32),), "extra"

    def not_a_module():
        return "model", (torch.randn(3, 32),)

    def dict_inputs():
        return Norm(), {"x": torch.randn(3, 32)}
    """
)


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "block.py"
    path.write_text(FACTORY)
    return path


def test_list_is_compact_and_never_cuts_names(capsys):
    import fusion_passes

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    firsts = {line.split()[0] for line in out.splitlines() if line.strip()}
    for f in fusion_passes.list_fusions():  # each name whole, at the start of its own line
        assert f.name in firsts, f.name
    assert "Unfused:" not in out  # the docs are behind `list NAME`
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["add_rms_norm"][1:3] == ["rms_norm", "all"]
    opt_in = next(f for f in fusion_passes.list_fusions() if not f.in_all)
    assert lines[opt_in.name][2] == "opt-in" and "opt-in: " in out


def test_list_name_shows_the_doc_and_json(capsys):
    assert main(["list", "add_rms_norm"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("add_rms_norm\n") and "family:    rms_norm" in out
    assert "Unfused:" in out and "Fused:" in out
    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["add_rms_norm"]["family"] == "rms_norm" and rows["add_rms_norm"]["in_all"]
    # a family is the patterns module that exports the fusion, whichever module its spellings come from
    assert (rows["masked_prefill_attention"]["family"], rows["sparse_decode_attention"]["family"]) == (
        "masked_prefill_attention", "sparse_decode_attention")  # fmt: skip
    assert all(r["opt_in"] for r in rows.values() if not r["in_all"])
    assert main(["list", "rms_norm", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["name"] == "rms_norm" and "Unfused:" in one["doc"]


def test_list_unknown_name_suggests(capsys):
    assert main(["list", "rms_nrom"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-passes: error: unknown fusion 'rms_nrom'; did you mean 'rms_norm'")
    assert err.count("\n") == 1


def test_diff_help_lists_built_in_models_and_defaults(capsys):
    from fusion_passes.models import MODEL_NAMES

    with pytest.raises(SystemExit) as exit_:
        main(["diff", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(name in out for name in MODEL_NAMES)
    for flag in ("--size", "--dtype", "--layers", "--device", "--fusions"):
        after = out.split(f" {flag} ", 1)[1]
        assert "(default:" in after.split(" --", 1)[0], flag


def test_readme_cli_lines_parse():
    """Every `fusion-passes ...` command line of the README is accepted by the parser."""
    import pathlib
    import shlex

    from fusion_passes.cli import _parser

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    commands = [
        line.split("fusion-passes ", 1)[1].split("#", 1)[0]
        for line in readme.splitlines()
        if line.startswith("fusion-passes ") or "&& fusion-passes " in line
    ]
    assert len(commands) >= 3
    for command in commands:
        _parser().parse_args(shlex.split(command))


def test_diff_on_a_factory_writes_text_and_json(factory_file, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["diff", f"{factory_file}:make", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "add_rms_norm" in out and "fusion_passes vs eager" in out
    data = json.loads(report.read_text())
    jsonschema.validate(data, DIFF_REPORT_SCHEMA)
    assert data["schema"] == "fusion_passes.diff/1"
    assert "dtype fp32 (the model's own), device cpu" in out
    assert (data["dtype"], data["dtype_from"], data["device"]) == ("fp32", "model", "cpu")
    assert {k: v for k, v in data["matches"].items() if v} == {"add_rms_norm": 1}
    assert data["sites"][0]["module"] == "norm"
    # The norm has no region to join: raised, then lowered back for Inductor to fuse.
    assert data["lowered_back"] == {"fusion_passes.add_rms_norm.default": 1}
    assert "lowered back" in out and "fusion_passes.add_rms_norm x1" in out
    assert all(check["ok"] for check in data["numerics"].values())
    # Lowered back, the generated code has stock Inductor's kernels and no call of a fused op.
    stock, ours = data["kernels"]["inductor"], data["kernels"]["fusion_passes"]
    assert stock["fused_ops"] == ours["fused_ops"] == 0
    assert ours["generated"] == stock["generated"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["diff", "qwen3.55"], "unknown model 'qwen3.55'; did you mean 'qwen3.5'?"),
        (["diff", "missing.py:make"], "no such file: missing.py"),
        (["diff", "qwen3", "--fusions", "rms_nrom"], "unknown fusion 'rms_nrom'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fusion-passes: error: {message}" or (message in err and "\n" not in err)


def test_factory_keeps_its_dtype_and_one_tensor_is_one_input(factory_file, tmp_path, capsys):
    report = tmp_path / "bf16.json"
    assert main(["diff", f"{factory_file}:bf16_one_tensor", "--json", str(report)]) == 0
    captured = capsys.readouterr()
    assert "returned one tensor as its example inputs" in captured.err
    assert "dtype bf16 (the model's own), device cpu" in captured.out
    data = json.loads(report.read_text())
    jsonschema.validate(data, DIFF_REPORT_SCHEMA)
    assert (data["dtype"], data["dtype_from"]) == ("bf16", "model")
    assert {k: v for k, v in data["matches"].items() if v} == {"rms_norm": 1}


@pytest.mark.parametrize(
    "args,message",
    [
        (["{f}:bare"], "returned only a Norm; expected (nn.Module, tuple of example inputs)"),
        (["{f}:triple"], "returned a tuple of 3 items; expected (nn.Module, tuple"),
        (["{f}:not_a_module"], "returned a str as the model; expected (nn.Module, tuple"),
        (["{f}:dict_inputs"], "returned a dict as the example inputs; expected (nn.Module, tuple"),
        (["{f}"], "name the factory too: path/to/file.py:factory"),
        (["{f}:make", "--json", "{tmp}/no/such/folder/r.json"], "the folder {tmp}/no/such/folder does not exist"),
        (["{f}:make", "--html", "{tmp}/missing/r.html"], "the folder {tmp}/missing does not exist"),
        (["{f}:make", "--json", "{tmp}"], "is a folder; give a file path"),
        (["{f}:make", "--fusions", ""], "--fusions is empty"),
        (["{f}:make", "--fusions", ",add_rms_nrom"], "unknown fusion 'add_rms_nrom'; did you mean 'add_rms_norm'"),
        (["{f}:make", "--device", "nonsense"], "--device 'nonsense' is not a device"),
        (["{f}:make", "--layers", "2"], "--layers applies to built-in models only"),
    ],
)
def test_diff_input_errors_before_any_compile(args, message, factory_file, tmp_path, monkeypatch, capsys):
    import fusion_passes.cli as cli

    def no_compile(*_):
        raise AssertionError("compiled before the error")

    monkeypatch.setattr(cli, "_compile_and_run", no_compile)
    argv = ["diff", *(a.format(f=factory_file, tmp=tmp_path) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(factory_file, capsys):
    assert main(["diff", f"{factory_file}:make", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: CUDA is not available" in err and err.count("\n") == 1


def test_factory_errors(factory_file, capsys):
    assert main(["diff", f"{factory_file}:nothing"]) == 2
    assert "has no factory named 'nothing'" in capsys.readouterr().err
    assert main(["diff", f"{factory_file}:broken"]) == 2
    err = capsys.readouterr().err
    assert "raised RuntimeError: no weights here" in err and err.count("\n") == 1


def test_graph_break_is_a_one_line_error(factory_file, capsys):
    assert main(["diff", f"{factory_file}:breaks"]) == 2
    err = capsys.readouterr().err
    assert "does not compile as one graph (fullgraph=True)" in err and err.count("\n") == 1
    assert "at block.py:" in err and "in forward (if (x + residual).sum().item() > 0" in err  # where it stopped


def test_console_script_and_debug_traceback(factory_file):
    """The installed command; --debug shows the traceback instead of one line."""
    run = [sys.executable, "-m", "fusion_passes.cli"]
    quiet = subprocess.run([*run, "diff", f"{factory_file}:broken"], capture_output=True, text=True)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    loud = subprocess.run(
        [*run, "--debug", "diff", f"{factory_file}:broken"], capture_output=True, text=True
    )
    assert loud.returncode != 0 and "Traceback" in loud.stderr


def test_built_in_model_report_validates_and_counts_sites(tmp_path):
    """DeepSeek V3.2 (tiny, 2 layers): every RMSNorm fused, and in each attention layer the MLA kv
    path, the q RoPE, and the indexer's q RoPE and key LayerNorm + RoPE; the MoE layer's
    group-limited router (the tiny config keeps one group: the one-hot mask's form) and its dispatch
    fused; no candidate left over (no near misses)."""
    path = tmp_path / "v32.json"
    assert main(["diff", "deepseek-v3.2", "--dtype", "bf16", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    jsonschema.validate(data, DIFF_REPORT_SCHEMA)
    matches = data["matches"]
    assert matches["rms_norm"] + matches["add_rms_norm"] == data["expected_rms_norm_sites"] == 9
    for fusion in ("mla_kv_norm_rope", "mla_q_rope", "mla_indexer_q_rope", "mla_indexer_k_norm_rope"):
        assert matches[fusion] == 2, (fusion, matches)
    assert matches["moe_sort_by_expert"] == matches["moe_route_grouped_one_group"] == 1
    assert data["near_misses"] == []
    assert data["errors"] == []


@pytest.mark.slow  # two whole-model decode compiles with every match checked on random inputs
@pytest.mark.parametrize("model,fusions", [("deepseek-v3.2", "all,moe_sort_gather,router_logits"),
                                           ("qwen3.5-moe", "all,moe_sort_gather,shared_input_linears")])  # fmt: skip
def test_verify_takes_every_fusion_of_a_decode_step(model, fusions, tmp_path):
    """--verify on a decode step: no fusion fails to be checked (integer outputs, cache slots, a
    mask of ones) and none is rejected, so verify changes nothing the step fuses. (The tiny
    DeepSeek V3.2's index top-k of 4 over relu'd scores ties at 0: the CPU's torch.topk keeps other
    tied keys than the kernel, which keeps the lowest positions as CUDA's does, so its step's
    numerics against eager on the CPU are not the point here: the exit code is not asserted.)"""
    path, checked = tmp_path / "verified.json", tmp_path / "plain.json"
    common = ["diff", model, "--dtype", "bf16", "--decode", "--context", "40", "--layers", "4", "--fusions", fusions]
    codes = main([*common, "--verify", "--json", str(path)]), main([*common, "--json", str(checked)])
    if model != "deepseek-v3.2":
        assert codes == (0, 0)
    verified, plain = json.loads(path.read_text()), json.loads(checked.read_text())
    assert verified["errors"] == [] and verified["rejected"] == plain["rejected"]
    assert {k: v for k, v in verified["final"].items() if v} == {k: v for k, v in plain["final"].items() if v}


def test_report_shape_summary_fates_tolerance_and_folded_rows(factory_file, tmp_path, capsys):
    """The summary line first, fusions without a rewrite folded into one line (--all-rows lists
    them), each rewrite's fate, the tolerance behind "ok", compile times in the JSON."""
    path = tmp_path / "r.json"
    assert main(["diff", f"{factory_file}:make", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    jsonschema.validate(data, DIFF_REPORT_SCHEMA)
    # The norm is raised, then lowered back (no region to join): no site left in the graph.
    assert data["summary"] == "0 sites in 0 fusions (1 more lowered back), 0 rejected, 0 near misses, numerics ok"
    assert out.index(data["summary"]) < out.index("fusions (sites")
    assert data["final"]["add_rms_norm"] == 0 and data["matches"]["add_rms_norm"] == 1
    assert [s["fate"] for s in data["sites"]] == ["lowered back"]
    assert "ran with no site" in out and "--all-rows lists them" in out
    assert data["tolerance"]["rel_norm"] > 0 and f"<= {data['tolerance']['rel_norm']:g} in fp32" in out
    assert set(data["compile_seconds"]) == {"inductor", "fusion_passes"} and "not a comparison" in out
    assert main(["diff", f"{factory_file}:make", "--all-rows"]) == 0
    assert "ran with no site" not in capsys.readouterr().out


def test_schema_fields_are_described_and_documented():
    """Every field of the JSON report has a description, and docs/report-schema.md is the schema
    rendered (regenerate it with the command the page names)."""
    from pathlib import Path

    from fusion_passes.report_schema import render_markdown

    for name, field in DIFF_REPORT_SCHEMA["properties"].items():
        assert field.get("description"), name
    page = Path(__file__).resolve().parents[2] / "docs" / "report-schema.md"
    assert page.read_text() == render_markdown()


def test_near_miss_reasons_of_broken_spellings(factory_file, tmp_path):
    path = tmp_path / "near.json"
    assert main(["diff", f"{factory_file}:broken_norms", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert sum(data["matches"].values()) == 0
    reasons = sorted(m["reason"] for m in data["near_misses"])
    assert reasons == [
        "aten.mean.dim argument 1 is [1], the spelling has [-1]",
        "expected aten.mean.dim, found aten.sum.dim_IntList",
        "expected aten.pow.Tensor_Scalar, found aten.abs.default",
    ]


@pytest.mark.slow  # a whole CLI run in a subprocess (about 14 s); test_factory_that_imports_torchao_leaves_stderr_clean keeps the check in CI
def test_diff_stderr_has_no_torchao_noise():
    """transformers imports torchao (its quantizer integration) when installed: a failed load of
    torchao's extensions and pytree deprecation warnings, nothing a built-in model needs."""
    run = [sys.executable, "-m", "fusion_passes.cli", "diff", "qwen3", "--dtype", "bf16", "--layers", "1"]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for noise in ("Failed to load", "torchao", "register_constant", "is an Enum subclass"):
        assert noise not in done.stderr, done.stderr


def test_factory_that_imports_torchao_leaves_stderr_clean(tmp_path):
    """A factory may use torchao (its FP8 models): its import-time noise is filtered, not blocked."""
    pytest.importorskip("torchao")
    path = tmp_path / "ao.py"
    path.write_text(
        "import torch\nimport torchao  # noqa: F401\n\n"
        "def make():\n"
        "    return torch.nn.RMSNorm(32, eps=1e-6), (torch.randn(2, 32),)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "fusion_passes.cli", "diff", f"{path}:make"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    for noise in ("Failed to load", "register_constant", "is an Enum subclass"):
        assert noise not in done.stderr, done.stderr


FIRST_STEP = textwrap.dedent(
    """
    import contextlib, sys
    import fusion_passes.cli as cli

    class Stop(BaseException):
        pass

    @contextlib.contextmanager
    def progress(console):
        steps = []

        def step(description):
            heavy = [
                m for m in ("transformers", "torchao", "torch._inductor.pattern_matcher") if m in sys.modules
            ]
            print(f"{description}|{heavy}", flush=True)
            steps.append(description)
            if len(steps) == 2:
                raise Stop
        yield step

    cli._progress = progress
    try:
        cli.main(sys.argv[1:])
    except Stop:
        pass
    """
)


@pytest.mark.parametrize("model", ["qwen3", "factory"])
def test_diff_shows_progress_before_the_model_imports(model, factory_file):
    """The first status line of diff comes before the framework's imports, the second before
    transformers is imported and the model built."""
    spec = f"{factory_file}:make" if model == "factory" else model
    done = subprocess.run(
        [sys.executable, "-c", FIRST_STEP, "diff", spec], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    first, second = (line.split("|") for line in done.stdout.splitlines()[:2])
    # The first line before the framework's imports (Inductor's pattern matcher), the second
    # before the model's.
    assert first == ["checking the options", "[]"]
    expected = "importing transformers to build qwen3" if model == "qwen3" else f"loading {spec}"
    assert second == [expected, "['torch._inductor.pattern_matcher']"]
