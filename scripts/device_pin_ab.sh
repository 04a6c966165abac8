#!/usr/bin/env bash
# Issue 19: client regions page-locked by the worker's pinning thread (SCRATCHD_PIN_THREAD=1,
# the default) against the loop's idle turns (0), side by side in one run on a lent GPU (the
# device tool), after scripts/device_setup.sh:
#   scripts/device_pin_ab.sh [REPEATS] [RATE]
# Each repeat runs both modes in turn (alternating which goes first): scripts/bench_serve.py on
# the region path, the one-view configuration, three 4 s Poisson loads of RATE req/s; then a
# table of every load's p50/p99 and the daemon's queue and compute medians. Files in $OUT.
set -u
REPEATS=${1:-2}; RATE=${2:-2000}
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
for rep in $(seq "$REPEATS"); do
    modes="1 0"; ((rep % 2 == 0)) && modes="0 1"
    for mode in $modes; do
        echo "== SCRATCHD_PIN_THREAD=$mode, repeat $rep"
        SCRATCHD_PIN_THREAD=$mode timeout 120 python3 scripts/bench_serve.py --backend cuda \
            --gpus 0 --size 1024 --views identity --max-batch 8 --path region \
            --data tests/fixtures/data --rates "$RATE,$RATE,$RATE" --duration 4 --grace 5 \
            --kills 0 --json "$OUT/pin-thread-$mode-$rep.json" \
            --daemon-log "$OUT/pin-thread-$mode-$rep.log" 2>&1 | grep -v -i warn | tail -5 | cut -c1-160
    done
done
python3 - <<'PY'
import glob, json, os
rows = {}
for f in sorted(glob.glob(os.environ["OUT"] + "/pin-thread-*-*.json")):
    mode = "thread" if os.path.basename(f).split("-")[2] == "1" else "idle turns"
    for r in json.load(open(f))["open_loop"]:
        rows.setdefault(mode, []).append(r)
print(f"{'pinning':>10}  {'p50 ms':>7} {'p99 ms':>7} {'queue p50':>9} {'compute p50':>11}  statuses")
for mode, runs in rows.items():
    for r in runs:
        p = r["parts"]
        print(f"{mode:>10}  {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} {p['queue_ms_p50']:9.2f} "
              f"{p['compute_ms_p50']:11.2f}  {r['statuses']}")
json.dump({m: [{k: r[k] for k in ("p50_ms", "p99_ms", "parts", "statuses", "lost")} for r in runs]
           for m, runs in rows.items()}, open(os.environ["OUT"] + "/pin-ab.json", "w"), indent=1)
PY
