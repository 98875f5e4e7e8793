"""Hypothesis profiles, and how many examples a kernel's property test draws.

A property test states what it draws on a GPU, ``@settings(max_examples=examples(n))``, and the
active profile scales it by its own ``max_examples`` against hypothesis' default of 100:

  gpu       100 (the default with CUDA): every example the test asks for.
  ci        CI_EXAMPLES (the default without CUDA, so under the Triton interpreter): a tenth,
            at least 2, drawn derandomized (the same examples every run).
  thorough  1000: ten times as many.

``HYPOTHESIS_PROFILE=<name>`` picks one (``HYPOTHESIS_PROFILE=gpu python -m pytest -m ""`` draws
on a CPU what a GPU draws); hypothesis' own ``--hypothesis-profile`` does too. A test without
``examples`` gets the profile's max_examples as it is. No profile has a deadline: the interpreter
is slow, and the first example of a kernel compiles it.

Why a tenth under the interpreter: one example of the FP8 kernels (norm + quant, SiLU + quant, at
up to 40 rows) took 1-2.3 s there once, so at 150-200 examples their four property tests took
143-344 s each on 2 cores, 14 of the suite's 29 minutes; now an example takes 0.15-0.5 s, and at
a tenth (20 examples of the norm + quant kernel, 15 of SiLU + quant) they take 3-8 s each. The
QK-norm + RoPE kernel's ~0.6 s an example and RMSNorm's ~0.1 s: 4 examples each, 3 s and 0.5 s.
The GPU run (benchmarks/run_gpu.sh) draws them all.
"""

from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, settings

PROFILE_VARIABLE = "HYPOTHESIS_PROFILE"
CI_EXAMPLES = 10  # the ci profile's max_examples: a tenth of what a test asks for on a GPU

settings.register_profile("gpu", max_examples=100, deadline=None)
settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run: a CI failure reproduces
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", max_examples=1000, deadline=None)


def load_profile(cuda: bool) -> str:
    """Load the profile $HYPOTHESIS_PROFILE names, else gpu with CUDA and ci without; its name."""
    name = os.environ.get(PROFILE_VARIABLE) or ("gpu" if cuda else "ci")
    settings.load_profile(name)
    return name


def examples(on_gpu: int) -> int:
    """The examples a test that draws ``on_gpu`` on a GPU draws under the active profile: scaled
    by its max_examples / 100, at least 2 (one example would check a single shape)."""
    scaled = math.ceil(on_gpu * settings().max_examples / 100)
    return max(min(2, on_gpu), scaled)
