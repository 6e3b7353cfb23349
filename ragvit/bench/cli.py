"""`python -m ragvit.bench`: check, then time, pruned timm ViT pipelines on this machine.

``python -m ragvit.bench [--config NAME] [--model deit_s] [--batches 1 16 64] ...`` runs one
named configuration (ragvit.bench.sweep.CONFIGS; flags override its fields), prints every
pipeline's max |dlogit| against the padded-masked reference and "all results match" before
any number, then the table of images/s; ``--out PREFIX`` writes PREFIX.json and PREFIX.csv.
Bad flags, models that are not a timm ViT/DeiT ragvit.patch accepts, --device cuda
without a GPU or CUDA build, a missing torch/timm (the ``ragvit[bench]`` extra) and
configurations a model cannot run are argparse usage errors (exit 2); a failed
correctness check exits 1. Models are random-init (pretrained=False): nothing is
downloaded, and speed does not depend on the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from .pipelines import DTYPES, GPU_ONLY, MODELS, PIPELINES, model_problem
from .report import render_table, write_results
from .sweep import CONFIGS, BenchConfig, ConfigError, cuda_problem, run

__all__ = ["config_from_args", "main", "parser"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ragvit.bench",
        description="Check, then time, pruned timm ViT pipelines (ragvit vs timm, the "
                    "padded reference and FA2 varlen).",
        epilog="configs: " + "; ".join(
            f"{k}: {v.model} keep={v.keep} thr={v.threshold} layers={v.layers}"
            for k, v in CONFIGS.items()))
    p.add_argument("--config", choices=list(CONFIGS), default="paper",
                   help="named configuration; the flags below override its fields")
    p.add_argument("--model", help=f"timm name or alias ({', '.join(MODELS)})")
    p.add_argument("--img-size", type=_positive_int, help="resolution (default: the model's)")
    p.add_argument("--dtype", choices=DTYPES, help="default fp16 on GPU, fp32 on CPU")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--keep", type=_ratio, help="ThresholdL2 fixed keep ratio")
    mode.add_argument("--threshold", type=_positive_float,
                      help="ThresholdL2 per-image threshold (ragged counts)")
    p.add_argument("--layers", type=int, nargs="+", help="pruning points (block indices)")
    p.add_argument("--batches", type=_positive_int, nargs="+", help="batch sizes")
    p.add_argument("--pipelines", nargs="+", choices=PIPELINES,
                   help="default: all that the device runs (on the CPU ragvit_compiled only "
                        "when named: compiling takes tens of seconds there)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--warmup", type=int, help="warm-up calls per figure")
    p.add_argument("--reps", type=_positive_int, help="timed calls per figure")
    p.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help="write OUT.json and OUT.csv")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a tqdm bar on a terminal, else plain lines)")
    return p


def config_from_args(args, p: argparse.ArgumentParser) -> BenchConfig:
    """The named config with the given flags applied; bad combinations are usage errors."""
    c = dataclasses.replace(CONFIGS[args.config])
    for name in ("model", "img_size", "dtype", "device", "warmup", "reps", "threads", "seed"):
        if getattr(args, name) is not None:
            setattr(c, name, getattr(args, name))
    if args.keep is not None:
        c.keep, c.threshold = args.keep, None
    if args.threshold is not None:
        c.keep, c.threshold = None, args.threshold
    for name in ("layers", "batches", "pipelines"):
        if getattr(args, name):
            setattr(c, name, tuple(getattr(args, name)))
    if c.warmup is not None and c.warmup < 0:
        p.error("--warmup must be >= 0")
    try:
        import timm
        import torch
    except ImportError as e:
        p.error(f"needs torch and timm: pip install 'ragvit[bench]' ({e})")
    name = MODELS.get(c.model, c.model)
    if not timm.is_model(name):
        p.error(f"--model: unknown timm model or alias {c.model!r} "
                f"(aliases: {', '.join(MODELS)})")
    if problem := model_problem(name, c.img_size):
        p.error(f"--model: {problem}")
    if c.device == "cuda" and (problem := cuda_problem()):
        p.error(f"--device cuda: {problem}")
    if c.pipelines and (c.device == "cpu" or not torch.cuda.is_available()):
        gpu_only = [n for n in c.pipelines if n in GPU_ONLY]
        if gpu_only:
            p.error(f"--pipelines {' '.join(gpu_only)}: GPU only")
    return c


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    config = config_from_args(args, p)
    try:
        result = run(config, progress=not args.no_progress)
    except ConfigError as e:
        p.error(str(e))
    print(render_table(result))
    if args.out:
        for path in write_results(args.out, result):
            print(f"wrote {path}")
    return 1 if result["failed"] else 0
