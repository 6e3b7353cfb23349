"""`python -m ragvit.bench`: the benchmark CLI (ragvit.bench.cli)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
