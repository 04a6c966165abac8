#!/usr/bin/env bash
# Several training variants side by side on one lent GPU (the device tool):
#   scripts/device_sweep.sh SHARDS MINUTES STOP_MINUTES "NAME ARGS..." ["NAME ARGS..." ...]
#
# Run from the repository root there, after scripts/device_setup.sh. Each variant trains with
# `scripts/train.py --minutes MINUTES --stop-minutes STOP_MINUTES ARGS` into /tmp/sweep/NAME and
# is packed as $OUT/NAME.tar.NN (checkpoint.pt, scratchnet.npz, curve.png, train_log.json,
# stdout.log): the device returns at most eight files. A checkpoint carried as
# .devdata/resume/NAME/checkpoint.pt is resumed (same ARGS; a larger MINUTES stretches the
# cosine). The nets are small, so the variants share the GPU without waiting on each other much.
set -u
SHARDS=$1; M=$2; STOP=$3; shift 3
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
pids=()
for spec in "$@"; do
    read -r name args <<<"$spec"
    dir=/tmp/sweep/$name
    mkdir -p "$dir"
    res=()
    [[ -f .devdata/resume/$name/checkpoint.pt ]] && res=(--resume ".devdata/resume/$name/checkpoint.pt")
    # shellcheck disable=SC2086  # ARGS is a word list on purpose
    python3 scripts/train.py --shards "$SHARDS" --out "$dir" --minutes "$M" --stop-minutes "$STOP" \
        --seed 1 --version "scratchnet-2.0-$name" "${res[@]}" $args 2>&1 \
        | grep --line-buffered -v -i warn >"$dir/stdout.log" &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for spec in "$@"; do
    read -r name _ <<<"$spec"
    tail -n 4 "/tmp/sweep/$name/stdout.log" | cut -c1-400
    # At most 16 MiB a file comes back: NAME.tar.00, NAME.tar.01, ... (cat them to untar).
    tar -C /tmp/sweep -cf - "$name" | split -b 15m -d - "$OUT/$name.tar."
done
