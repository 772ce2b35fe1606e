#!/bin/bash
# The read-only hardware check on a machine with an NVIDIA GPU and its driver but none of this
# project's packages (they come as wheels in .whl/, generated gRPC code in agent/pb/): make hw-check's
# tests, then the agent itself on the real NVML, offline, as the walk-through drives it, with a whole
# GPU prepared and unprepared (a CDI spec and a metadata file; the GPU is never reconfigured: no MIG,
# no sharing, no passthrough). Output under $OUT (default ./hw-out).
set -u
OUT=${OUT:-hw-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
step() { echo; echo "=== $*"; }
NVML=${NVML:-real}  # NVML=sim: a dry run of this script on a machine without a GPU
step machine; uname -a; nproc; nvidia-smi || [ "$NVML" = sim ] || exit 1
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,driver_version,compute_cap,mig.mode.current,persistence_mode --format=csv
nvidia-smi -q > "$OUT/nvidia-smi-q.txt" 2>&1
nvidia-smi mig -lgip 2>&1 | head -40
ls -l /dev/nvidia* 2>&1; ls /proc/driver/nvidia/gpus 2>&1; cat /proc/driver/nvidia/version 2>&1
python3 --version; python3 -m pip show nvidia-ml-py 2>/dev/null | head -2
step packages
[ "$NVML" = sim ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
step "make hw-check (tests/hw)"
python3 -m pytest -p no:cacheprovider --noconftest -v -rs tests/hw  # tests/conftest.py loads the API emulator's packages
R=/tmp/hwrun
export DRA_KUBELET_DIR=$R/kubelet DRA_OFFLINE=$R/offline DRA_STATE_DIR=$R/state DRA_CDI_DIR=$R/cdi \
       DRA_STATIC_CDI_DIR=$R/cdi-static DRA_NVML=$NVML
step "seed + agent on the real NVML"
python3 examples/seed.py $R
python3 -m agent run --nvml $NVML --offline-fallback $R/offline --kubelet-dir $R/kubelet --cdi-dir $R/cdi \
  --static-cdi-dir $R/cdi-static --state-dir $R/state --metrics-address 127.0.0.1:9477 > "$OUT/agent.log" 2>&1 &
AGENT=$!
for i in $(seq 1 60); do python3 -m agent kubelet info > /dev/null 2>&1 && break; sleep 0.5; done
cli() { echo "\$ dra-agent $*"; timeout 60 python3 -m agent "$@"; echo "(exit $?)"; }
cli kubelet info
cli devices
python3 -m agent devices -o json > "$OUT/devices.json"
cli slices
cli kubelet prepare default/gpu-one
cat $R/cdi/*claim_*.json; echo
meta=$(python3 -m agent claims default/gpu-one --metadata); echo "$meta"; cat "$meta"; echo
cli claims
cli kubelet health --once
cli doctor
python3 -c 'import urllib.request as u; print(u.urlopen("http://127.0.0.1:9477/metrics").read().decode())' | grep -E '^dra_' | grep -v _bucket | head -60
cli kubelet unprepare default/gpu-one
ls $R/cdi
kill -TERM $AGENT; wait $AGENT; echo "agent exit $?"
step "agent log (tail)"; tail -60 "$OUT/agent.log"
step "MIG mode unchanged"; nvidia-smi --query-gpu=mig.mode.current,compute_mode --format=csv
