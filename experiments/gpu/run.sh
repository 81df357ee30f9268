#!/usr/bin/env bash
# One accelerator window on the paper-budget queue (experiments/gpu/queue.py), on a bare machine
# with no network: install the library without dependencies, read the CIFAR-10 tarball from the
# git-ignored data_cache/ folder that travels with the working tree, train the next rows not yet
# published inside MAX_SECONDS, and leave in OUTDIR the bundle of returned rows
# (gpu_queue.tar.gz, rewritten after each row), the device report and the log.
#
#   bash experiments/gpu/run.sh OUTDIR [MAX_SECONDS] [gpu_queue flags...]
#
# MAX_SECONDS (default 540) counts from this script's start, installation and decoding included.
# Back on the CPU machine: python -m experiments.run gpu_queue --publish OUTDIR/gpu_queue.tar.gz
set -uo pipefail
out=${1:?usage: run.sh OUTDIR [MAX_SECONDS] [gpu_queue flags...]}
max=${2:-540}
shift $(( $# >= 2 ? 2 : 1 ))
start=$(date +%s)
cd "$(dirname "$0")/../.."
mkdir -p "$out"
# No network there: no build isolation (it would fetch setuptools); if the install still
# fails, the checkout itself is put on the path.
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1; then
  echo "pip install -e . failed (see install.log); using PYTHONPATH"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export JAXPRUNE_DATA="${JAXPRUNE_DATA:-$PWD/data_cache}"
export JAXPRUNE_CACHE="${JAXPRUNE_CACHE:-/tmp/jaxprune_cache}"
export PYTHONUNBUFFERED=1
if [ ! -f "$JAXPRUNE_DATA/cifar10-jpeg.tar.gz" ]; then
  echo "no $JAXPRUNE_DATA/cifar10-jpeg.tar.gz: copy the tarball into data_cache/ and carry it" >&2
  exit 2
fi
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
left=$(( max - ($(date +%s) - start) ))
python3 -m experiments.run gpu_queue --max-seconds "$left" --out runs/gpu_queue \
  --bundle "$out/gpu_queue.tar.gz" "$@" 2>&1 | tee "$out/gpu_queue.log"
status=${PIPESTATUS[0]}
cp runs/gpu_queue/device_report.md "$out/" 2>/dev/null
echo "gpu_queue exit $status after $(( $(date +%s) - start )) s"
exit "$status"
