"""One benchmark configuration, checked and then timed: what `python -m ragvit.bench` runs.

A BenchConfig names a timm model, resolution, dtype, ThresholdL2 policy, batch sizes and
pipelines; `run` loads the model (random init), checks every pipeline against the
padded-masked reference on each batch size and prints "all results match" before it times
anything (ragvit.bench.timing.time_ms: CUDA events on the GPU, perf_counter on the CPU).
`check_then_time` is the same protocol for the grid benchmarks in benchmarks/. A row that
fails its check is never timed.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from .pipelines import (
    COMPILED,
    GPU_ONLY,
    MODELS,
    PIPELINES,
    check,
    load_model,
    make_pipeline,
    make_policy,
    model_problem,
    torch_dtype,
)
from .report import environment, start_run
from .timing import time_ms

__all__ = ["CONFIGS", "BenchConfig", "ConfigError", "check_then_time", "cuda_problem", "run"]


def cuda_problem() -> str | None:
    """Why CUDA cannot run ragvit's pipelines here (one line), or None when it can.

    Needs torch to see a GPU (a driver and a device) and ragvit to be built with its
    kernels and to see a device; the first missing piece is named.
    """
    import torch

    from .. import ops

    if not torch.cuda.is_available():
        return "torch finds no CUDA GPU (no NVIDIA driver or no visible device)"
    if not ops.cuda_is_compiled():
        return ("this ragvit build has no CUDA kernels (built without nvcc or with "
                "RAGVIT_NO_CUDA=1); rebuild it where the CUDA toolkit is installed")
    if not ops.cuda_available():
        return "ragvit's kernels find no usable CUDA device (driver older than the build?)"
    return None


@dataclass
class BenchConfig:
    """One benchmark run. Fields left None take a device-dependent default in `resolve`."""

    model: str = "deit_s"
    img_size: int | None = None
    dtype: str | None = None
    keep: float | None = 0.5
    threshold: float | None = None
    layers: tuple[int, ...] = (4,)
    batches: tuple[int, ...] | None = None
    pipelines: tuple[str, ...] | None = None
    device: str = "auto"
    warmup: int | None = None
    reps: int | None = None
    seed: int = 0
    threads: int | None = None

    def resolve(self) -> BenchConfig:
        """A copy with every None filled in for the device this process can use."""
        import torch

        from .. import ops

        c = dataclasses.replace(self)
        if c.device == "auto":
            c.device = "cuda" if torch.cuda.is_available() and ops.cuda_available() else "cpu"
        gpu = c.device == "cuda"
        c.model = MODELS.get(c.model, c.model)
        if c.img_size is None:
            c.img_size = 384 if "_384" in c.model else 224
        c.dtype = c.dtype or ("fp16" if gpu else "fp32")
        c.batches = tuple(c.batches or ((1, 16, 64) if gpu else (1, 2)))
        # on the CPU the compiled pipelines run only when named (inductor's CPU compile of a
        # ViT takes tens of seconds to minutes on a small machine)
        default = PIPELINES if gpu else tuple(p for p in PIPELINES if p not in COMPILED)
        c.pipelines = tuple(p for p in (c.pipelines or default) if gpu or p not in GPU_ONLY)
        c.warmup = c.warmup if c.warmup is not None else (10 if gpu else 1)
        c.reps = c.reps if c.reps is not None else (50 if gpu else 5)
        return c

    @property
    def policy_name(self) -> str:
        mode = f"keep{self.keep:g}" if self.threshold is None else f"thr{self.threshold:g}"
        return f"l2_{mode}_b{'_'.join(map(str, self.layers))}"


# Named configurations (flags given next to --config override their fields).
CONFIGS = {
    "paper": BenchConfig(),  # DeiT-S 224, ThresholdL2 keep 50% after block 4
    "deit_b": BenchConfig(model="deit_b", batches=(1, 4, 16, 64, 256)),
    "deit_b384": BenchConfig(model="deit_b384", batches=(1, 16, 64)),
    "multistage": BenchConfig(keep=0.3, layers=(4, 7, 10)),
    "ragged": BenchConfig(keep=None, threshold=1.0),
    "tiny": BenchConfig(model="deit_t", img_size=64, dtype="fp32", device="cpu",
                        batches=(1, 2), warmup=1, reps=3, threads=1),
}


class ConfigError(ValueError):
    """A configuration that cannot run on its model (e.g. pruning layers past the depth)."""


def _progress(total: int, enabled: bool, file=None):
    """Progress over `total` steps on `file` (default sys.stderr): a tqdm bar on a terminal;
    one plain line per step where the stream is not a terminal (a log, CI, a pipe), which
    a bar's carriage-return redraws would fill with fragments; nothing when not enabled.
    The result has update(), set_postfix_str() (names the step starting) and close()."""
    file = file if file is not None else sys.stderr
    is_tty = getattr(file, "isatty", lambda: False)()
    if enabled and is_tty:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc="ragvit.bench", file=file, leave=False)
        except ImportError:
            pass
    return _ProgressLines(total, file if enabled else None)


class _ProgressLines:
    """The plain-line stand-in for the tqdm bar (see _progress); file None: silent."""

    def __init__(self, total: int, file):
        self.total, self.done, self.file = total, 0, file

    def update(self, n=1):
        self.done += n

    def set_postfix_str(self, s):
        if self.file is not None:
            print(f"ragvit.bench [{self.done + 1}/{self.total}] {s}", file=self.file,
                  flush=True)

    def close(self):
        pass


def run(config: BenchConfig | None = None, *, progress: bool = True, log=print) -> dict:
    """Checks, then times, one configuration.

    Args:
        config: what to run (None: the paper's configuration on the best device).
        progress: show progress on stderr: a tqdm bar on a terminal, plain lines
            otherwise (and without tqdm).
        log: where progress lines go (print, or a no-op).

    Returns:
        {"config": resolved fields, "env": environment(), "rows": [one per batch size:
         {"batch", "check": check(...), "timing": {pipeline: {"ms": {...}, "images_per_s"}}}],
         "failed": number of batch sizes failing the check (those are not timed)}.
    """
    import torch

    start_run()  # the host-speed probe at the run's start
    c = (config or BenchConfig()).resolve()
    if c.threads:
        torch.set_num_threads(c.threads)
    if c.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    if problem := model_problem(c.model, c.img_size):
        raise ConfigError(problem)
    model = load_model(c.model, c.img_size, c.dtype, c.device, c.seed)
    try:
        policy = make_policy(c.keep, c.threshold, c.layers)
        policy.check(len(model.blocks))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    gen = torch.Generator(device="cpu").manual_seed(c.seed)
    inputs = {b: torch.randn(b, 3, c.img_size, c.img_size, generator=gen).to(
        c.device, torch_dtype(c.dtype)) for b in c.batches}
    rows = []
    bar = _progress(len(c.batches) * (1 + len(c.pipelines)), progress)
    if log is print and hasattr(bar, "write"):
        log = bar.write  # tqdm.write: lines above the bar instead of through it
    try:
        with torch.inference_mode():
            for b in c.batches:
                bar.set_postfix_str(f"check BS {b}")
                row = {"batch": b, "check": check(model, inputs[b], policy, c.pipelines, c.dtype)}
                rows.append(row)
                bar.update()
                errs = ", ".join(f"{n} {e:.2e}" if e is not None else f"{n} n/a"
                                 for n, e in row["check"]["err"].items())
                log(f"BS {b}: max |dlogit| vs reference: {errs}; top-1 agreement "
                    f"{row['check']['top1_agree']:.3f}; kept {row['check']['kept_fraction']:.3f}")
                for name, why in row["check"]["unavailable"].items():
                    log(f"  {name} unavailable: {why[:200]}")
            failed = sum(not r["check"]["ok"] for r in rows)
            log("all results match" if not failed
                else f"{failed} batch sizes FAILED correctness (not timed)")
            for row in rows:
                row["timing"] = {}
                for name in c.pipelines:
                    bar.set_postfix_str(f"{name} BS {row['batch']}")
                    if row["check"]["ok"] and row["check"]["err"][name] is not None:
                        with make_pipeline(name, model, policy, inputs[row["batch"]]) as fn:
                            ms = time_ms(fn, c.device, c.warmup, c.reps)
                        row["timing"][name] = {
                            "ms": {"median": ms.median, "p20": ms.p20, "p80": ms.p80},
                            "images_per_s": row["batch"] / (ms.median / 1e3)}
                    bar.update()
    finally:
        bar.close()
    cfg = dataclasses.asdict(c)
    cfg["policy"] = c.policy_name
    return {"config": cfg, "env": environment(c.device), "rows": rows, "failed": failed}


def check_then_time(cases, check_case, time_case, is_ok):
    """Checks every case first (prints "all results match" before any number), then
    times the cases that passed: row = check_case(case), time_case(case, row) where
    is_ok(row). Returns (rows, number of failed rows)."""
    rows = [check_case(case) for case in cases]
    bad = sum(1 for row in rows if not is_ok(row))
    print("all results match" if not bad else f"{bad} grid points FAILED correctness",
          flush=True)
    for case, row in zip(cases, rows, strict=True):
        if is_ok(row):
            time_case(case, row)
    return rows, bad
