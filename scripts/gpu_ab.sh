#!/usr/bin/env bash
# A/B timing of two builds of ragvit in one device call: benchmarks/bench_e2e.py runs with
# each build's package first on PYTHONPATH, alternately (A B A B ...: drift lands on both),
# then a table of every row's ragvit figures per build and B / A (medians over the runs).
# Usage: scripts/gpu_ab.sh DIR_A DIR_B [ROUNDS] [-- bench_e2e.py args]
#   default args: --suite graph --models "DeiT-S 224" "DeiT-B 224" --batches 1 4; ROUNDS 2
# DIR_X/ragvit comes from scripts/build_variant.sh; carry the ab/ folder to the device.
# Logs and JSON go to $OUT/ab (or ./gpu_logs/ab).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,8p "$0"; exit 2; }
a=$(realpath "$1"); b=$(realpath "$2"); shift 2
rounds=2
if [ $# -ge 1 ] && [ "$1" != "--" ]; then rounds=$1; shift; fi
[ $# -ge 1 ] && [ "$1" = "--" ] && shift
if [ $# -eq 0 ]; then
    set -- --suite graph --models "DeiT-S 224" "DeiT-B 224" --batches 1 4
fi
out=${OUT:-$PWD/gpu_logs}/ab
mkdir -p "$out"
for dir in "$a" "$b"; do  # each build must be the ragvit the benchmark imports
    got=$(cd / && PYTHONPATH=$dir python3 -c "import ragvit; print(ragvit.__file__)") || exit 1
    case $got in "$dir"/*) echo "ragvit from $got" ;; *) echo "$dir: imports $got"; exit 1 ;; esac
done
export PYTHONUNBUFFERED=1
for r in $(seq 1 "$rounds"); do
    for v in A B; do
        dir=$a; [ $v = B ] && dir=$b
        PYTHONPATH=$dir python3 benchmarks/bench_e2e.py "$@" --out "$out/${v}_$r" \
            > "$out/${v}_$r.log" 2>&1 || echo "run $v $r failed: see $out/${v}_$r.log"
    done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
figs = {}
for v in "AB":
    for r in range(1, rounds + 1):
        try:
            rows = json.load(open(f"{out}/{v}_{r}.json"))["rows"]
        except (OSError, ValueError):
            continue
        for row in rows:
            for name, t in row.get("timing", {}).items():
                if name.startswith("ragvit"):
                    key = (row["suite"], row["model"], row["policy"], row["batch"], name)
                    figs.setdefault(key, {"A": [], "B": []})[v].append(t["images_per_s"])
print("| suite | model | policy | BS | pipeline | A img/s | B img/s | B / A | runs |")
print("|---|---|---|---|---|---|---|---|---|")
for key, f in figs.items():
    if f["A"] and f["B"]:
        ma, mb = statistics.median(f["A"]), statistics.median(f["B"])
        print(f"| {' | '.join(map(str, key))} | {ma:.0f} | {mb:.0f} | {mb / ma:.3f} | "
              f"{len(f['A'])} / {len(f['B'])} |")
PY
