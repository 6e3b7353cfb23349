"""Helpers shared by the test files (fixtures and pytest hooks live in conftest.py).

tolerances: dtypes and the per-dtype tables; inputs: seeded factories, poison, cu_seqlens,
bit comparisons; lengths: the named length sets of the attention tests; errors: the error
tables every op's `rejects` test runs; devices: device parameters, GPU marks and CUDA
helpers; checks: assertions against a float64 reference and a baseline; references: float64
references more than one file needs; models: timm models for the patch and policy tests.
Imported as `from support.inputs import poison` (tests/ is on sys.path under pytest).
"""
