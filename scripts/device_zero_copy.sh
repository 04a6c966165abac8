#!/usr/bin/env bash
# Issue 19's record on a lent GPU machine (the device tool), after scripts/device_setup.sh:
#   scripts/device_zero_copy.sh GPUS [REPEATS] [RATE] [WARMUP]   e.g. 0   or   0,1 5 4000 5
#
# The main process's CPU per 1024x1024 request over the socket and from a registered region
# (scripts/bench_frontend.py, both paths alternating), then scripts/bench_serve.py with the
# one-view configuration on the cards GPUS, each path, REPEATS loads of RATE req/s and a
# kill -9 run, and scripts/zero_copy_record.py assembling $OUT/zero-copy.json from them.
# WARMUP (s, default 0): each Poisson load first runs that long on the same connections,
# uncounted (bench_serve.py --warmup: the steady state, regions page-locked); the kill run
# and the burst have none. The daemon's logs (region_page_locked: when each ring was whole)
# are kept beside the JSON.
# Frames are mosaics of tests/fixtures/data (the device has no ../shared).
set -u
GPUS=$1; REPEATS=${2:-5}; RATE=${3:-2000}; WARMUP=${4:-0}
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
rates=$(for _ in $(seq "$REPEATS"); do printf "%s," "$RATE"; done); rates=${rates%,}
timeout 120 python3 scripts/bench_frontend.py --data tests/fixtures/data --sizes 1024 \
    --duration 2 --clients 1 --window 8 --paths socket,region --repeats 5 \
    --json "$OUT/frontend.json" 2>&1 | tail -8
for path in region socket; do
    timeout 200 python3 scripts/bench_serve.py --backend cuda --gpus "$GPUS" --size 1024 \
        --views identity --max-batch 8 --path "$path" --data tests/fixtures/data \
        --rates "$rates" --duration 4 --warmup "$WARMUP" --grace 5 --kills 1 --kill-gap 4 \
        --kill-rate "$RATE" \
        --json "$OUT/serve-$path.json" --daemon-log "$OUT/daemon-$path.log" 2>&1 \
        | grep -v -i warn | tail -12 | cut -c1-200
done
python3 scripts/zero_copy_record.py --frontend "$OUT/frontend.json" \
    --serve "$OUT"/serve-region.json "$OUT"/serve-socket.json --json "$OUT/zero-copy.json"
