"""WHAT is detected: one module per fusion family. Each lists the unfused spellings found in real
model code, maps them to ONE canonical op of ``fusion_passes.lowering`` and exports its fusions as
``FUSIONS`` (cache_writes.py: the cache-write spellings several families share). Importing a module
registers nothing: ``fusion_passes.fusion_order`` says which families run, in which order, and why."""
