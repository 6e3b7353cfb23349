"""Shared test machinery: per-test seeds, the dtype tolerance table, tensor
factories, poison helpers, and the GPU / sanitizer markers.

Every random input comes from a torch.Generator seeded from a hash of the test's
node id, so a failure reproduces by re-running that one test; the seed is
attached to the report of every failing test ("ragvit seed" section). Inputs
are generated on the CPU and then moved, so the same node id gives the same
numbers on every device. Helpers are plain functions importable as
`from conftest import ...` (pytest puts this folder on sys.path; the insert
below keeps that true under --import-mode=importlib).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# ---- tolerances ----

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# Per-dtype assert_close tolerances against the float64 reference (from torch's
# own transformer tests; fp32 assumes TF32 off, which this file enforces).
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    # torch's table says atol 1e-3, but bf16 SDPA itself misses it: rounding the output
    # (and P) to bf16 gives ~1.6e-3 absolute error on unit-variance V at length 577
    # (measured on the CPU, SDPA and a FA2-style P-in-bf16 emulation alike).
    torch.bfloat16: {"atol": 4e-3, "rtol": 1.6e-2},
}

# Additive floors of flash-attention's rule err(ragvit) <= 2 * err(SDPA) + floor.
ERROR_FLOOR = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}

# cls_attn is float32 whatever q's dtype; probabilities are compared absolutely.
CLS_ATTN_ATOL = 1e-5

INT32_POISON = -(2**31) + 7  # poison for int32 outputs (cu_seqlens, indices)

# fp32 matmuls (SDPA baseline, references on the GPU) must not silently use TF32.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

# ---- CUDA availability and markers ----


def _ragvit_cuda_available() -> bool:
    try:
        import ragvit
    except ImportError:
        return False
    return bool(ragvit.cuda_available())


CUDA_OK = torch.cuda.is_available() and _ragvit_cuda_available()

requires_cuda = pytest.mark.skipif(
    not CUDA_OK, reason="needs torch CUDA and a CUDA build of ragvit with a visible GPU"
)


def gpu_marks() -> list:
    """Marks for a CUDA-only test or parameter: the `gpu` marker plus the skip."""
    return [pytest.mark.gpu, requires_cuda]


def set_args(**changes):
    """A mutation for the error tables: sets args[name] = fn(args) (or the plain value)
    for each change."""

    def mutate(a):
        for name, value in changes.items():
            a[name] = value(a) if callable(value) else value

    return mutate


def matrix_input_errors(op: str, name: str, shape: tuple[int, int]) -> list:
    """Error-table rows shared by the ops whose argument `name` is a (rows, cols) float
    matrix with a unit column stride (linear's and the row ops' x, topk_index's scores):
    1-D and 3-D, int32 and float64, a list, a column stride. `shape` is the base
    argument's (cols even); op may be "{op}" for a table formatted per op later."""
    rows, cols = shape

    def change(fn):
        return set_args(**{name: fn})

    dims = rf"{op}: {name} must have 2 dimensions"
    dtype = rf"{op}: {name} must be float16, bfloat16 or float32, got "
    return [
        (f"{name}_1d", change(lambda a: a[name].reshape(-1)), ValueError, dims, False),
        (f"{name}_3d", change(lambda a: a[name].reshape(rows, 2, cols // 2)), ValueError, dims,
         False),
        (f"{name}_int32", change(lambda a: a[name].to(torch.int32)), TypeError, dtype + "int32",
         False),
        (f"{name}_float64", change(lambda a: a[name].double()), TypeError, dtype + "float64",
         False),
        (f"{name}_list", change(lambda a: a[name].tolist()), TypeError,
         rf"{op}: {name} must be an array", False),
        (f"{name}_last_dim_strided",
         change(lambda a: torch.randn((cols, rows), device=a[name].device).t()), ValueError,
         rf"{op}: {name} must be contiguous in its last dimension \(stride 1\), got stride "
         rf"{rows}", False),
    ]


def error_params(cases, *leading) -> list:
    """pytest params (*leading, device, mutate, exc, pattern) of an error table whose rows are
    (case_id, mutate, exc, pattern, cpu_only), for "cpu" and "cuda" (CUDA rows marked
    gpu_marks(), cpu_only rows left out); ids "<leading>-<device>-<case_id>"."""
    params = []
    for device in ("cpu", "cuda"):
        for case_id, mutate, exc, pattern, cpu_only in cases:
            if cpu_only and device == "cuda":
                continue
            marks = gpu_marks() if device == "cuda" else []
            params.append(pytest.param(*leading, device, mutate, exc, pattern, marks=marks,
                                       id="-".join([*map(str, leading), device, case_id])))
    return params


def devices() -> list:
    """Parameters for a `device` argument: "cpu", and "cuda" (skipped without a GPU).

    The CUDA parameter is always listed, so a CPU-only run reports it as skipped
    instead of silently collecting fewer tests.
    """
    return [
        pytest.param("cpu", id="cpu"),
        pytest.param("cuda", id="cuda", marks=gpu_marks()),
    ]


def dtype_params(dtypes=DTYPES) -> list:
    """Parameters for a `dtype` argument, with ids fp32 / fp16 / bf16."""
    return [pytest.param(d, id=DTYPE_IDS[d]) for d in dtypes]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and a CUDA build of ragvit")
    config.addinivalue_line(
        "markers", "sanitizer: small GPU cases meant to run under compute-sanitizer (-m sanitizer)"
    )


# ---- seeds ----


def seed_for(nodeid: str) -> int:
    """A stable 63-bit seed derived from a test's node id."""
    digest = hashlib.sha256(nodeid.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@pytest.fixture
def seed(request) -> int:
    """The seed of this test; recorded so a failure report prints it."""
    value = seed_for(request.node.nodeid)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A CPU torch.Generator seeded from this test's node id."""
    return torch.Generator(device="cpu").manual_seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(
                    (
                        "ragvit seed",
                        f"seed={value} (torch.Generator().manual_seed({value}); "
                        f"node {item.nodeid})",
                    )
                )


@pytest.fixture(autouse=True)
def _restore_ragvit_debug():
    """Leaves ragvit's debug switch as each test found it."""
    try:
        import ragvit
    except ImportError:
        yield
        return
    before = ragvit.is_debug()
    yield
    ragvit.set_debug(before)


# ---- factories ----


def random_lengths(gen: torch.Generator, num_seqs: int, lo: int, hi: int, include=()) -> list[int]:
    """num_seqs lengths: every value of `include` once, the rest uniform in [lo, hi].

    Args:
        gen: CPU generator.
        num_seqs: S, how many lengths in all (>= len(include)).
        lo, hi: inclusive bounds of the random lengths.
        include: lengths that must appear (e.g. 1, 197, 577), placed at random
            positions.

    Returns:
        A list of S non-negative ints.
    """
    include = list(include)
    if len(include) > num_seqs:
        raise ValueError("num_seqs must be >= len(include)")
    count = num_seqs - len(include)
    rand = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
    lengths = rand + include
    order = torch.randperm(num_seqs, generator=gen).tolist()
    return [lengths[i] for i in order]


def make_cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """(S+1,) int32 exclusive prefix sums of lengths, on device."""
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + int(length))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_qkv(
    gen: torch.Generator,
    total_tokens: int,
    num_heads: int,
    head_dim: int,
    dtype=torch.float32,
    device="cpu",
    layout="contiguous",
    std: float = 1.0,
):
    """Random q, k, v of shape (T, H, D).

    Args:
        gen: CPU generator.
        total_tokens, num_heads, head_dim: T, H, D.
        dtype: float dtype of the results.
        device: where the results live.
        layout: "contiguous" (three separate tensors) or "qkv_view" (q, k, v are
            the views [:, 0], [:, 1], [:, 2] of one (T, 3, H, D) buffer, as a qkv
            projection produces them: token stride 3*H*D).
        std: standard deviation of the normal samples.

    Returns:
        (q, k, v).
    """
    shape = (total_tokens, 3, num_heads, head_dim)
    buf = (torch.randn(shape, generator=gen) * std).to(dtype=dtype, device=device)
    if layout == "qkv_view":
        return buf[:, 0], buf[:, 1], buf[:, 2]
    if layout == "contiguous":
        return tuple(buf[:, i].contiguous() for i in range(3))
    raise ValueError(f"unknown layout {layout!r}")


def poison(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A new tensor filled with poison: NaN for floats, INT32_POISON for ints."""
    if dtype.is_floating_point:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    if dtype == torch.bool:
        raise ValueError("bool tensors cannot be poisoned")
    return torch.full(shape, INT32_POISON, dtype=dtype, device=device)


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor like t (shape, dtype, device, contiguous) filled with poison."""
    return poison(tuple(t.shape), t.dtype, t.device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU integer view of t's bits, so NaN compares equal to itself."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.view(view)
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b hold bit-identical values (NaN included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def covered_rows(cu_seqlens, total_tokens: int) -> torch.Tensor:
    """(T,) bool CPU mask of rows covered by some sequence of a valid cu_seqlens."""
    cu = torch.as_tensor(cu_seqlens).detach().to("cpu", torch.int64).tolist()
    mask = torch.zeros(total_tokens, dtype=torch.bool)
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        mask[start:end] = True
    return mask


def seed_note(seed: int) -> str:
    """Suffix for assertion messages that names the seed."""
    return f" [seed={seed}]"


# ---- named length sets shared by the attention tests: (gen, on_cuda) -> (lengths, T) ----


def lengths_one_token(gen, on_cuda):
    return [1], 1


def lengths_deit_197(gen, on_cuda):
    return [197], 197


def lengths_deit_577(gen, on_cuda):
    return [577], 577


def lengths_zero_length(gen, on_cuda):
    lengths = [0, 5, 0, 0, 37, 1, 0] if not on_cuda else [0, 5, 0, 0, 197, 1, 0, 64, 0]
    return lengths, sum(lengths)
