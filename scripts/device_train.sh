#!/usr/bin/env bash
# Training on a lent GPU machine (the device tool): scripts/device_train.sh SHARDS MINUTES ARGS...
#
# Run from the repository root there, with the wheels the machine lacks in .whl/ and the shards
# (`scratchd shard build DATA .devdata/shards`) carried. Everything lands in $OUT/m:
# checkpoint.npz, scratchnet.npz, curve.png, train_log.json, stdout.log. A checkpoint at
# .devdata/resume/checkpoint.npz is resumed (same flags; a larger MINUTES stretches the cosine).
# Give the call a timeout of at least 60 * MINUTES + 150 s (setup, warm-up, inner-split pass).
set -u
SHARDS=$1; M=$2; shift 2
bash scripts/device_setup.sh || exit 1
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
mkdir -p "$OUT/m"
RES=()
[[ -f .devdata/resume/checkpoint.npz ]] && RES=(--resume .devdata/resume/checkpoint.npz)
python3 scripts/train.py --shards "$SHARDS" --out "$OUT/m" --minutes "$M" --seed 1 "${RES[@]}" "$@" 2>&1 \
    | grep --line-buffered -v -i warn | tee "$OUT/m/stdout.log" | cut -c1-3000
ls -la "$OUT/m"
