import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only under the interpreter, and the variable is read when
    # triton is first imported: set it before any test module imports a kernel.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tests run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
