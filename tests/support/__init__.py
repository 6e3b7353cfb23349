"""Helpers shared by the test files; fixtures and pytest hooks live in conftest.py.

tolerances: dtypes and tolerance tables; inputs: seeded factories, poison, bit comparisons;
lengths: the named sequence-length sets; errors: the error tables and the rows several ops
share; devices: device params and GPU marks; cuda: graph capture, streams, the debug switch;
checks: the float64-reference and baseline assertions; references: float64 references two
files need; models: timm models and patched-forward checks. Imported as `from support.inputs
import poison` (pytest puts tests/ on sys.path).
"""
