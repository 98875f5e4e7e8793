"""How many examples a kernel's hypothesis test draws.

On a GPU every example a test asks for. Under the CPU's Triton interpreter a quarter: there one
example of the FP8 kernels takes 1-2.3 s, and at 150-200 examples their four property tests took
143-344 s each on 2 cores, 14 of the suite's 29 minutes (38-82 s at a quarter). The GPU run
(benchmarks/run_gpu.sh) draws them all.
"""

from __future__ import annotations

import torch


def examples(on_gpu: int) -> int:
    """on_gpu on a CUDA machine; a quarter of it (at least 1) under the interpreter."""
    return on_gpu if torch.cuda.is_available() else max(1, on_gpu // 4)
