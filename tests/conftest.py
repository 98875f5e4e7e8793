import os

import pytest
import torch

INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")
if not torch.cuda.is_available():
    # Triton kernels run on the CPU only under the interpreter, and the variable is read when
    # triton is first imported: set it before any test module imports a kernel.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        raise pytest.UsageError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
            "on this CPU: nothing may import triton before tests/conftest.py"
        )

# The hypothesis profile (tests/_hypothesis.py): $HYPOTHESIS_PROFILE, else gpu with CUDA, ci without
# (hypothesis' --hypothesis-profile, read later, overrides it).
from _hypothesis import load_profile  # noqa: E402
from hypothesis import settings  # noqa: E402

load_profile(cuda=torch.cuda.is_available())

# Tests that share state a worker builds once, kept on one pytest-xdist worker under
# --dist loadgroup: the whole-model compiles of tests/_compiled_models.py (one group for the three
# files that read them), the decode steps of tests/models/test_models_decode.py, and each module whose
# tests read one spawned process group.
XDIST_GROUPS = {
    "models/test_models_fusion.py": "compiled_models",
    "qk_norm_rope/test_models_qk_norm_rope.py": "compiled_models",
    "mla_rope/test_models_mla_rope.py": "compiled_models",
    # its tests share one cached DecodeStep per model and its compiled steps (functools.cache)
    "models/test_models_decode.py": "decode_steps",
    "allreduce_rms_norm/test_allreduce_rms_norm.py": "gloo_allreduce_rms_norm",
    "allreduce_rms_norm_quant_fp8/test_allreduce_rms_norm_quant_fp8.py": "gloo_allreduce_rms_norm_quant_fp8",
    "models/test_models_tensor_parallel.py": "gloo_models_tensor_parallel",
}
TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_report_header(config):
    return f"hypothesis profile: {settings.get_current_profile_name()} (tests/_hypothesis.py)"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = XDIST_GROUPS.get(os.path.relpath(str(item.path), TESTS).replace(os.sep, "/"))
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") == "1" != INTERPRET_AT_START:
            # Set by a test module on import, it turns every kernel imported after it into an
            # interpreted one: the GPU tests would run (and fail) in the interpreter.
            raise pytest.UsageError("TRITON_INTERPRET=1 was set during collection on a CUDA machine")
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tests run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_deselected_slow: list[str] = []


def pytest_deselected(items):
    _deselected_slow.extend(item.nodeid for item in items if "slow" in item.keywords)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say what the default -m "not slow" left out, and how to run it (the count is known where
    this process collected: not in pytest-xdist's controller)."""
    xdist_controller = config.pluginmanager.hasplugin("dsession")
    if _deselected_slow or (xdist_controller and "not slow" in (config.option.markexpr or "")):
        count = f"{len(_deselected_slow)} tests" if _deselected_slow else "Tests"
        terminalreporter.write_line(
            f'{count} marked slow were deselected (-m "not slow", the default); '
            'the full suite: python -m pytest -m ""'
        )
