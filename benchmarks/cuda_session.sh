#!/usr/bin/env bash
# What a lent CUDA GPU runs in one call (docs/performance.md, "The host-bound regime"):
# the host-bound benchmark against a CUDA graph in fp32 and bf16 (and the compiled loops),
# the CUDA-only tests and tests/test_cuda.py. (Not the whole suite: it is a CPU suite, and
# with a GPU visible torch's defaults put its FSDP2 and DDP test models on the GPU.)
# Run from the repository root; OUT (default ./cuda-out) receives the logs and the JSON.
set -u
OUT=${OUT:-cuda-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' \
  | tee -a "$OUT/gpu.txt"
for flags in "" "--bf16"; do
  timeout 120 python3 benchmarks/host_bound.py --device cuda --json $flags \
    > "$OUT/host_bound${flags:+_bf16}.json" 2> "$OUT/host_bound${flags:+_bf16}.err"
  echo "host_bound $flags: rc $?"
done
timeout 150 python3 benchmarks/host_bound.py --device cuda --compiled --json \
  > "$OUT/host_bound_compiled.json" 2> "$OUT/host_bound_compiled.err"
echo "host_bound --compiled: rc $?"
timeout 200 python3 -m pytest -p no:cacheprovider -n 0 -q -rs tests/test_cuda.py \
  tests/observe/test_host_syncs.py tests/observe/test_doctor.py tests/data/test_to_device.py \
  tests/step/test_probe.py tests/logging/test_log_state.py > "$OUT/cuda_tests.log" 2>&1
echo "CUDA tests: rc $?"; tail -15 "$OUT/cuda_tests.log"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("host_bound*.json")):
    try:
        rows = json.loads(f.read_text())
    except ValueError:
        print(f.name, "no JSON:", f.with_suffix(".err").read_text()[-400:]); continue
    for r in rows:
        print(f.name, r["precision"], r["contender"], r["us_per_step"], r["ratio_to_limit"])
PY
