import os

import pytest
import torch

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tests run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
