#!/usr/bin/env bash
# Prepare a fresh lent GPU machine (the device tool) from the repository root there: install the
# wheels it lacks (carried in .whl/, see ../shared/gpu/prepare-wheels.sh) into /tmp/site, build
# the C extensions in place and expose the checkout as the `scratchd` package under /tmp/pkg.
# Afterwards: export PYTHONPATH=/tmp/site:/tmp/pkg
set -eu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
python3 setup.py -q build_ext --inplace >/tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/scratchd
