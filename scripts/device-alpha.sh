#!/usr/bin/env bash
# The alpha run for a lent accelerator host (issue 48; DGR-066 and DGR-061): one call, from a copy
# of a committed tree, with what this machine built carried along (no network there), its records
# left under $OUT to be committed as the stories' evidence.
#
#   scripts/device-alpha.sh          on the GPU host: the CUDA lane
#   scripts/device-alpha.sh --dry    here: the same steps on the CPU lane, with fewer rounds
#
# Steps (each timed, its log in $OUT/<step>.log, a failure recorded and the next step run):
#   host      the host's fingerprint (cores, CPU, GPUs): what the gate's host condition reads
#   preflight the CUDA driver, device and build the lane needs, named when missing (not --dry)
#   build     the lane's llama.cpp and engine (a carried build is reused; else built from the
#             pinned tree on the host)
#   certify   `dgr_cert.certify --lane LANE`: layout parity (CPU lane: bitwise; another lane: NMSE
#             <= 1e-4 against the CPU lane's whole model, greedy identical), sealed records
#   bench     the gate's loopback rows with every stage (and RPC server) on cores of its own
#   bench-wan the gate's WAN rows, pinned the same way
#   gate      `dgr-prd gate alpha` over the records just made (rows the host cannot measure say so)
# The commit the copy was made from comes from git where the copy has it, else $DGR_SOURCE_COMMIT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dry=0
[[ "${1:-}" == "--dry" ]] && dry=1
out="${OUT:-$PWD/device-out}"
mkdir -p "$out"
lane=cuda
rounds=(--rounds 3 --paired-rounds 3)
wan=()
if ((dry)); then
  lane=cpu
  rounds=(--rounds 1 --paired-rounds 1 --threads 2)
  wan=(--threads 2)
fi
if [[ -z "${DGR_SOURCE_COMMIT:-}" ]] && git rev-parse HEAD >/dev/null 2>&1; then
  export DGR_SOURCE_COMMIT="$(git rev-parse HEAD)"
fi
run() { python3 -m uv run --offline --locked --all-packages "$@"; }
failed=()
step() {
  local name=$1 t0=$SECONDS
  shift
  echo "device-alpha: $name: $*" | tee -a "$out/steps.log"
  if "$@" >"$out/$name.log" 2>&1; then
    echo "device-alpha: $name: ok ($((SECONDS - t0)) s)" | tee -a "$out/steps.log"
  else
    echo "device-alpha: $name: FAILED, exit $? ($((SECONDS - t0)) s)" | tee -a "$out/steps.log"
    tail -n 20 "$out/$name.log"
    failed+=("$name")
  fi
}

echo "device-alpha: lane $lane, commit ${DGR_SOURCE_COMMIT:-unknown}, records in $out" | tee "$out/steps.log"
step host run dgr-prd fingerprint
if ((!dry)); then
  step preflight run python -c "from dgr_cert.lane_probe import preflight_cuda; print(preflight_cuda())"
fi
step build run nox -s native-build -- --lane "$lane"
step certify run python -m dgr_cert.certify --lane "$lane" --model smollm2-135m-q4_1 --stages 2 3 \
  --out "$out/certification/$lane"
step bench run python -m dgr_bench.bench "${rounds[@]}" --pin-stages
step bench-wan run python -m dgr_bench.bench_wan "${wan[@]}" --pin-stages
mkdir -p "$out/bench"
cp evidence/bench/bench-route.json evidence/bench/bench-wan.json "$out/bench/" 2>/dev/null
step gate run dgr-prd gate alpha
if ((dry)) && git rev-parse HEAD >/dev/null 2>&1; then
  # a dry run leaves the tree's committed evidence as it was: its records are under $OUT only
  git checkout -- evidence/bench/bench-route.json evidence/bench/bench-wan.json 2>/dev/null
fi
echo "device-alpha: done in ${SECONDS} s; failed: ${failed[*]:-none}" | tee -a "$out/steps.log"
# the gate's verdict is the stories' business (a row this host cannot measure fails it): the run
# fails only where a step that makes records failed
for f in "${failed[@]}"; do [[ "$f" != gate ]] && exit 1; done
exit 0
