"""The fusion-passes CLI: list, diff on a user factory (text + JSON), and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jsonschema
import pytest

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
    """
)


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "block.py"
    path.write_text(FACTORY)
    return path


def test_list_shows_every_fusion_and_its_doc(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "add_rms_norm" in out and "rms_norm" in out and "Unfused:" in out and "Fused:" in out


def test_diff_on_a_factory_writes_text_and_json(factory_file, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["diff", f"{factory_file}:make", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "add_rms_norm" in out and "fusion_passes vs eager" in out
    data = json.loads(report.read_text())
    jsonschema.validate(data, DIFF_REPORT_SCHEMA)
    assert data["schema"] == "fusion_passes.diff/1"
    assert {k: v for k, v in data["matches"].items() if v} == {"add_rms_norm": 1}
    assert data["sites"][0]["module"] == "norm"
    assert data["ops_after"]["fusion_passes.add_rms_norm.default"] == 1
    assert all(check["ok"] for check in data["numerics"].values())
    # On CPU the fused op runs its reference through the dispatcher: one call, one kernel fewer.
    stock, ours = data["kernels"]["inductor"], data["kernels"]["fusion_passes"]
    assert stock["fused_ops"] == 0 and ours["fused_ops"] == 1
    assert ours["generated"] == stock["generated"] - 1


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
    path, the q RoPE, and the indexer's q RoPE and key LayerNorm + RoPE; no candidate left over."""
    path = tmp_path / "v32.json"
    assert main(["diff", "deepseek-v3.2", "--dtype", "bf16", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    jsonschema.validate(data, DIFF_REPORT_SCHEMA)
    matches = data["matches"]
    assert matches["rms_norm"] + matches["add_rms_norm"] == data["expected_rms_norm_sites"] == 9
    for fusion in ("mla_kv_norm_rope", "mla_q_rope", "mla_indexer_q_rope", "mla_indexer_k_norm_rope"):
        assert matches[fusion] == 2, (fusion, matches)
    assert data["near_misses"] == [] and data["errors"] == []


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
