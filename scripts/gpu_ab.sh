#!/usr/bin/env bash
# A/B timing of two or more builds of ragvit on one GPU: benchmarks/bench_e2e.py runs with
# each build's package first on PYTHONPATH, in turn (A B C A B C ...: drift lands on all),
# then a table of every row's ragvit figures per build and each build over the first
# (medians over the runs). For attention alone: bench_attention.py --rows, once per build.
# Usage: scripts/gpu_ab.sh DIR_A DIR_B [DIR_C ...] [ROUNDS] [-- bench_e2e.py args]
#   default args: --suite graph --models "DeiT-S 224" "DeiT-B 224" --batches 1 4; ROUNDS 2
# DIR_X/ragvit comes from scripts/build_variant.sh. Logs and JSON go to $OUT/ab (default
# ./gpu_logs/ab); AB_TAG names a subfolder (several comparisons in one folder).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,9p "$0"; exit 2; }
dirs=()
rounds=2
while [ $# -ge 1 ] && [ "$1" != "--" ]; do
    case $1 in
        *[!0-9]*) dirs+=("$(realpath "$1")") ;;
        *) rounds=$1 ;;
    esac
    shift
done
[ $# -ge 1 ] && [ "$1" = "--" ] && shift
[ ${#dirs[@]} -ge 2 ] || { echo "gpu_ab.sh: need at least two build folders"; exit 2; }
if [ $# -eq 0 ]; then
    set -- --suite graph --models "DeiT-S 224" "DeiT-B 224" --batches 1 4
fi
out=${OUT:-$PWD/gpu_logs}/ab${AB_TAG:+/$AB_TAG}
mkdir -p "$out"
for dir in "${dirs[@]}"; do  # each build must be the ragvit the benchmark imports
    got=$(cd / && PYTHONPATH=$dir python3 -c "import ragvit; print(ragvit.__file__)") || exit 1
    case $got in "$dir"/*) echo "ragvit from $got" ;; *) echo "$dir: imports $got"; exit 1 ;; esac
done
export PYTHONUNBUFFERED=1
for r in $(seq 1 "$rounds"); do
    for i in "${!dirs[@]}"; do
        PYTHONPATH=${dirs[$i]} python3 benchmarks/bench_e2e.py "$@" --out "$out/v${i}_$r" \
            > "$out/v${i}_$r.log" 2>&1 || echo "run v$i $r failed: see $out/v${i}_$r.log"
    done
done
python3 - "$out" "$rounds" "${dirs[@]}" <<'PY'
import json, os, statistics, sys
out, rounds, dirs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
names = [os.path.basename(d.rstrip("/")) for d in dirs]
figs = {}
for i in range(len(dirs)):
    for r in range(1, rounds + 1):
        try:
            rows = json.load(open(f"{out}/v{i}_{r}.json"))["rows"]
        except (OSError, ValueError):
            continue
        for row in rows:
            for name, t in row.get("timing", {}).items():
                if name.startswith("ragvit"):
                    key = (row["suite"], row["model"], row["policy"], row["batch"], name)
                    figs.setdefault(key, [[] for _ in dirs])[i].append(t["images_per_s"])
print("img/s, median over runs; each build / " + names[0])
print("| suite | model | policy | BS | pipeline | "
      + " | ".join(f"{n} img/s" for n in names) + " | "
      + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
print("|---" * (5 + 2 * len(names) - 1) + "|")
for key, f in figs.items():
    med = [statistics.median(v) if v else float("nan") for v in f]
    print(f"| {' | '.join(map(str, key))} | " + " | ".join(f"{m:.0f}" for m in med) + " | "
          + " | ".join(f"{m / med[0]:.3f}" for m in med[1:]) + " |")
PY
