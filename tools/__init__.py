"""Tuning and research scripts, run from the repository root as modules (python -m tools.NAME):
launch-shape sweeps behind the kernels' defaults (tune_*), A/B runs of a kernel against a git
revision (ab_*), probes of numeric forms (probe_*), offline SASS hashes (sass_hashes, run as a
script: see its docstring), the census of rewritten sites (site_census) and a decode step's
kernels as Inductor writes them for sm_90, counted on a machine without a GPU (sm90_kernels). The user-facing
benchmarks are in benchmarks/.
"""
