"""WHAT a fusion becomes: one folder per family, each with the canonical fused ops (``op.py``,
torch.library), the plain-torch reference that states their math and runs on any device
(``reference.py``) and the kernels that run on CUDA (``triton.py``, ``symm_mem.py``); device
code that several families share is in ``common/``, launch rules per GPU in ``launch_tables.py``.

Importing this package registers every family's ops (``torch.ops.fusion_passes.*``): each
folder's ``op.py`` is imported, so a new family needs no line here.
"""

import importlib
import pkgutil

FAMILIES = tuple(
    module.name
    for module in pkgutil.iter_modules(__path__)
    if module.ispkg and module.name != "common"
)
for _family in FAMILIES:
    importlib.import_module(f"{__name__}.{_family}.op")
