#!/usr/bin/env bash
# One call of the accelerator run on the GPU machine (benchmarks/README.md, "On a GPU"), from the repository root:
#     bash benchmarks/accelerator/device.sh 1      # carry .accel-pack/call1
#     bash benchmarks/accelerator/device.sh 2      # carry .accel-pack/call2, at once after call 1
#     bash benchmarks/accelerator/device.sh hf     # carry .accel-pack/hf: the HF in/out check alone (~120 s)
# It unpacks the pack's site-packages (with Python's tarfile: no xz binary needed; p2pd keeps its mode) into
# $CF_SITE (default /tmp/site, kept while the machine stays warm), puts them first on PYTHONPATH, and runs the call
# into $OUT. Further arguments go to `python -m benchmarks.accelerator` (e.g. --cap science=300).
# Whatever fails, $OUT/callN.json and callN.md say what (the script writes them as it goes; where it never got to
# write them, e.g. a missing pack, this script does).
set -u
call=${1:?give the call: 1, 2 or hf}
shift
out=${OUT:?OUT is not set (the device tool sets it)}
case $call in 1|2) pack=${CF_PACK:-.accel-pack}/call$call ;; *) pack=${CF_PACK:-.accel-pack}/$call ;; esac
site=${CF_SITE:-/tmp/site}

fail() {  # the call's JSON and summary with the failure, unless the script wrote its own
    local rc=$1 msg=$2
    echo "device.sh: $msg" >&2
    mkdir -p "$out"
    [ -f "$out/call$call.json" ] && return
    python3 - "$out" "$call" "$rc" "$msg" <<'PY'
import json, sys, time
out, call, rc, msg = sys.argv[1:]
rec = {"call": call, "device_sh": {"exit": int(rc), "error": msg}, "phases": {},
       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
open(f"{out}/call{call}.json", "w").write(json.dumps(rec, indent=1))
open(f"{out}/call{call}.md", "w").write(f"# Accelerator run, call {call}\n\nFailed before any phase ran (exit {rc}): {msg}\n")
PY
}

[ -f "$pack/site.tar.xz" ] || { fail 2 "$pack/site.tar.xz is missing: carry $pack (python -m benchmarks.accelerator --pack .accel-pack here)"; exit 2; }
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$pack/site.tar.xz" "$site" \
    || { fail 2 "unpacking $pack/site.tar.xz into $site failed"; exit 2; }
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
python3 -m benchmarks.accelerator --call "$call" --from-pack "$pack" --out "$out" "$@"
rc=$?
[ $rc -eq 0 ] || fail $rc "python -m benchmarks.accelerator --call $call exited with $rc"
exit $rc
