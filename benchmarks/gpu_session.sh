#!/usr/bin/env bash
# The GPU runs behind benchmarks/results, on the device machine (2×H200), in stages that fit one
# 10-minute call each; run the stages in order on one warm machine (files outside the repository
# copy, such as FlashInfer's JIT cache and /tmp/site, persist between calls to a warm machine).
#   stage 1: install (carry .whl from ../shared/tools/device-wheels.sh flashinfer), start
#            FlashInfer's JIT builds in the background, the core GPU tests, bench norm
#   stage 2: FlashInfer's GPU tests, the vendor conformance kit, bench allreduce
#   stage 3: bench decode, the MoE/TBO GPU tests, the feature matrix (record + tests)
# Logs and results go to $OUT (the device tool brings them back).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage=${1:?stage 1, 2 or 3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/mhc -e plugins/flashinfer \
  -e plugins/cutedsl -e plugins/rocm_aiter >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
versions() { python3 - <<'PY'
import torch, triton
try:
    import flashinfer; fi = flashinfer.__version__
except Exception as e: fi = f"unavailable ({type(e).__name__})"
print(f"torch {torch.__version__} cuda {torch.version.cuda} triton {triton.__version__} flashinfer {fi}")
for i in range(torch.cuda.device_count()): print(torch.cuda.get_device_name(i))
PY
}
pt() { timeout "$1" python3 -m pytest -q -rs -p no:cacheprovider "${@:2}"; }
case "$stage" in
1)
  versions | tee "$OUT/versions.txt"
  # FlashInfer's norm module first (bench norm waits for it), then the all-reduce fusion (~5 min).
  ( setsid nohup python3 -c "
from flashinfer.jit.norm import gen_norm_module; gen_norm_module().build_and_load(); open('/tmp/fi_norm_done','w')
from flashinfer.jit.comm import gen_trtllm_comm_module; gen_trtllm_comm_module().build_and_load(); open('/tmp/fi_comm_done','w')
" > /tmp/fi_jit.log 2>&1 < /dev/null & )
  CUDA_VISIBLE_DEVICES=0 pt 420 tests/test_triton_kernels.py tests/test_fp8_reads.py tests/test_conformance_core.py \
    > "$OUT/stage1-triton.log" 2>&1 &
  for _ in $(seq 120); do [ -f /tmp/fi_norm_done ] && break; sleep 2; done
  CUDA_VISIBLE_DEVICES=1 timeout 300 layer-boundary bench norm --out "$OUT" > "$OUT/bench-norm.log" 2>&1
  wait
  pt 200 tests/test_fused_allreduce.py tests/test_gpu_parallel.py tests/test_gpu_model.py > "$OUT/stage1-parallel.log" 2>&1
  tail -3 "$OUT"/stage1-*.log; tail -5 "$OUT/bench-norm.log"; tail -3 /tmp/fi_jit.log
  ;;
2)
  # FlashInfer's fused candidate is opt-in until verified; spawned ranks dump their stacks if a
  # run stops making progress (the first attempt, 2026-11-30, stopped without a trace).
  export LAYER_BOUNDARY_FLASHINFER_FUSION=1 LAYER_BOUNDARY_HANG_DUMP_S=120
  for _ in $(seq 200); do [ -f /tmp/fi_comm_done ] && break; sleep 2; done
  tail -3 /tmp/fi_jit.log
  pt 300 -m gpu tests/test_flashinfer_gpu.py tests/test_vendor_conformance.py > "$OUT/stage2-flashinfer.log" 2>&1
  timeout 280 layer-boundary bench allreduce --out "$OUT" > "$OUT/bench-allreduce.log" 2>&1
  timeout 200 layer-boundary bench finalize --out "$OUT" > "$OUT/bench-finalize.log" 2>&1
  tail -5 "$OUT/stage2-flashinfer.log"; tail -30 "$OUT/bench-allreduce.log"; tail -80 "$OUT/bench-finalize.log"
  ;;
3)
  timeout 420 layer-boundary bench decode --out "$OUT" > "$OUT/bench-decode.log" 2>&1
  tail -30 "$OUT/bench-decode.log"
  pt 150 -m gpu tests/test_moe_parallel.py tests/test_tbo.py > "$OUT/stage3-tests.log" 2>&1; tail -3 "$OUT/stage3-tests.log"
  # The feature matrix on NCCL: the dated record (md + JSON in $OUT), then the same cases as tests.
  timeout 150 python3 benchmarks/gpu_feature_matrix.py --out "$OUT" > "$OUT/gpu-features.log" 2>&1; tail -26 "$OUT/gpu-features.log"
  pt 150 -m gpu tests/test_gpu_features.py > "$OUT/stage3-features.log" 2>&1; tail -3 "$OUT/stage3-features.log"
  ;;
esac
