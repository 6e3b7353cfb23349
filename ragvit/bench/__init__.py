"""Benchmarks of pruned timm ViTs: ragvit against the pipelines PyTorch users have.

    timing     the one timer: host µs (perf_counter_ns medians, interleaved pairs), GPU µs
               (CUDA-graph replay, L2 flushed, rotated blocks), end-to-end ms (CUDA events)
    pipelines  timm eager / graph, the padded-masked reference, the paper's FA2 pipeline,
               FA2 packed, ragvit eager / graph / compiled; `check` against the reference
    sweep      BenchConfig, the named CONFIGS, `run` (check, then time, one configuration)
    report     environment(), tables, JSON/CSV/Markdown writers, load_results
    cli        `python -m ragvit.bench`

Importing the package imports neither torch nor timm (every function that needs them
imports them), so ragvit.bench.timing's host timers serve NumPy-only code such as
ragvit.demo. The names below are re-exported for `from ragvit import bench`.
"""

from __future__ import annotations

from .cli import main
from .pipelines import (
    MODELS,
    PIPELINES,
    check,
    fa2_attention,
    graphed,
    load_model,
    make_pipeline,
    make_policy,
    max_err,
    own_decisions_err,
    paper_forward,
    patched,
    timm_forward,
)
from .report import (
    environment,
    flat_rows,
    load_result_folders,
    load_results,
    render_table,
    write_results,
)
from .sweep import CONFIGS, BenchConfig, ConfigError, run
from .timing import time_ms

__all__ = [
    "CONFIGS", "MODELS", "PIPELINES", "BenchConfig", "ConfigError", "check", "environment",
    "fa2_attention", "flat_rows", "graphed", "load_model", "load_result_folders", "load_results",
    "main", "make_pipeline", "make_policy", "max_err", "own_decisions_err", "paper_forward",
    "patched", "render_table", "run", "time_ms", "timm_forward", "write_results",
]
