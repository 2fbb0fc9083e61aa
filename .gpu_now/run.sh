#!/usr/bin/env bash
# One-off GPU stages for this session (not committed): 1 = core GPU tests (+ unpack CuTe DSL), 2 = CuTe DSL + MHC GPU tests.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/mhc -e plugins/flashinfer \
  -e plugins/cutedsl -e plugins/rocm_aiter $( [ -d plugins/app ] && printf -- '-e plugins/app' ) >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
pt() { timeout "$1" python3 -m pytest -q -rs -p no:cacheprovider "${@:2}"; }
case "$1" in
1)
  mkdir -p /tmp/cute_parts && cp .cute1a/* /tmp/cute_parts/ && touch /tmp/cute1_done
  python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/versions.txt"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/versions.txt"
  files=$(ls tests/test_*.py | grep -v -e test_mhc -e cutedsl -e flashinfer_gpu -e test_docs)
  pt 470 -m gpu $files > "$OUT/core-gpu.log" 2>&1; tail -25 "$OUT/core-gpu.log"
  ;;
2)
  [ -f /tmp/cute1_done ] || { echo "machine not warm: redo stage 1"; exit 3; }
  mkdir -p /tmp/site && cat /tmp/cute_parts/cu13part.aa .cute1b/* | xz -T8 -dc | tar -xf - -C /tmp/site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 .cute2/*.whl \
    && cp -rn /tmp/site2/. /tmp/site/ || exit 1
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages CUTE_DSL_ARCH=sm_90a
  python3 -c "import cutlass; print('cutlass', cutlass.__version__)" | tee -a "$OUT/versions.txt"
  pt 330 -m gpu tests/test_mhc_cluster.py tests/test_mhc_split.py tests/test_mhc_persistent.py tests/test_cutedsl_plugin.py > "$OUT/cute-mhc.log" 2>&1; tail -15 "$OUT/cute-mhc.log"
  pt 230 -m gpu tests/test_mhc_kernels.py tests/test_mhc_launch_forms.py tests/test_mhc_config.py > "$OUT/triton-mhc.log" 2>&1; tail -15 "$OUT/triton-mhc.log"
  ;;
esac
