#!/usr/bin/env bash
# One call of the accelerator run on the GPU machine (benchmarks/README.md, "On a GPU"), from the repository root:
#     bash benchmarks/accelerator/device.sh 1      # carry .accel-pack/call1
#     bash benchmarks/accelerator/device.sh 2      # carry .accel-pack/call2, at once after call 1
# It unpacks the pack's site-packages (with Python's tarfile: no xz binary needed; p2pd keeps its mode) into
# $CF_SITE (default /tmp/site, kept while the machine stays warm), puts them first on PYTHONPATH, and runs the call
# into $OUT. Further arguments go to `python -m benchmarks.accelerator` (e.g. --cap science=300).
set -u
call=${1:?give the call: 1 or 2}
shift
pack=${CF_PACK:-.accel-pack}/call$call
site=${CF_SITE:-/tmp/site}
[ -f "$pack/site.tar.xz" ] || { echo "device.sh: $pack/site.tar.xz is missing: carry $pack (python -m benchmarks.accelerator --pack .accel-pack here)" >&2; exit 2; }
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$pack/site.tar.xz" "$site" || exit 2
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
exec python3 -m benchmarks.accelerator --call "$call" --from-pack "$pack" --out "${OUT:?OUT is not set (the device tool sets it)}" "$@"
