#!/usr/bin/env bash
# Several training variants side by side on one lent GPU (the device tool):
#   [SWEEP_BUDGET_S=N] scripts/device_sweep.sh SHARDS MINUTES STOP_MINUTES "NAME ARGS..." ...
#
# Run from the repository root there, after scripts/device_setup.sh. Each variant trains with
# `scripts/train.py --minutes MINUTES --stop-minutes STOP_MINUTES ARGS` into /tmp/sweep/NAME and
# is packed as $OUT/NAME.tar.NN (checkpoint.npz, scratchnet.npz, curve.png, train_log.json,
# stdout.log): the device returns at most eight files. A checkpoint carried as
# .devdata/resume/NAME/checkpoint.npz is resumed (same ARGS; a larger MINUTES stretches the
# cosine). The nets are small, so the variants share the GPU without waiting on each other much.
#
# SWEEP_BUDGET_S: seconds from the start after which every variant still training is sent
# SIGTERM (train.py then ends the step in progress, writes its checkpoint, runs the inner-split
# pass and exports); SWEEP_GRACE_S (default 120) later, whatever is left is killed and what
# exists is packed. Set the budget so that budget + grace ends inside the command's limit:
# a command killed at its limit packs nothing.
set -u
SHARDS=$1; M=$2; STOP=$3; shift 3
BUDGET=${SWEEP_BUDGET_S:-0}; GRACE=${SWEEP_GRACE_S:-120}
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
pids=()
for spec in "$@"; do
    read -r name args <<<"$spec"
    dir=/tmp/sweep/$name
    mkdir -p "$dir"
    res=()
    [[ -f .devdata/resume/$name/checkpoint.npz ]] && res=(--resume ".devdata/resume/$name/checkpoint.npz")
    # shellcheck disable=SC2086  # ARGS is a word list on purpose
    python3 scripts/train.py --shards "$SHARDS" --out "$dir" --minutes "$M" --stop-minutes "$STOP" \
        --seed 1 --version "scratchnet-2.0-$name" "${res[@]}" $args >"$dir/stdout.log" 2>&1 &
    pids+=($!)
done
if ((BUDGET > 0)); then
    (
        sleep "$BUDGET"
        echo "sweep: budget of $BUDGET s spent, asking every variant to stop"
        kill -TERM "${pids[@]}" 2>/dev/null
        sleep "$GRACE"
        echo "sweep: grace of $GRACE s spent, killing what is left"
        kill -KILL "${pids[@]}" 2>/dev/null
    ) &
    watchdog=$!
fi
for pid in "${pids[@]}"; do wait "$pid"; done
[[ -n ${watchdog:-} ]] && kill "$watchdog" 2>/dev/null
for spec in "$@"; do
    read -r name _ <<<"$spec"
    grep -v -i warn "/tmp/sweep/$name/stdout.log" | tail -n 4 | cut -c1-400
    # At most 16 MiB a file comes back: NAME.tar.00, NAME.tar.01, ... (cat them to untar).
    tar -C /tmp/sweep -cf - "$name" | split -b 15m -d - "$OUT/$name.tar."
done
