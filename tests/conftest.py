"""pytest fixtures and hooks: per-test seeds, the debug switch, markers, run-wide settings.

Every random input comes from a torch.Generator seeded from a hash of the test's node id
(`gen`), so a failure reproduces by re-running that one test; the seed is attached to the
report of every failing test ("ragvit seed" section). Shared helpers live in support/.
"""

from __future__ import annotations

import hashlib

import pytest
import torch


def pytest_configure(config):
    # The markers (gpu, multi_gpu, sanitizer) are declared in pyproject.toml.
    # fp32 matmuls (SDPA and torch baselines, references on the GPU) must not silently use
    # TF32: support.tolerances' fp32 row assumes full fp32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


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


# ---- state a test may change ----


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


@pytest.fixture(scope="module")
def one_cpu_thread():
    """One torch thread for a module of tiny models: intra-op threads only add barrier
    waits there (seconds on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test, so the test traces afresh: every
    patched model shares its forward's code, and Dynamo reuses a version compiled by an
    earlier test whose guards still pass, and past torch._dynamo.config.recompile_limit
    versions it refuses to compile (fullgraph=True) or runs the code eagerly."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
