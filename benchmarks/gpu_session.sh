#!/usr/bin/env bash
# The GPU runs behind benchmarks/results, on the device machine (2×H200), as three calls to one
# warm machine, each under the 10-minute limit and each carrying one ≤64 MiB bundle (files
# outside the repository copy, such as /tmp/site and FlashInfer's JIT cache, persist between calls
# to a warm machine). Prepare the bundles here first:
#   ../shared/tools/device-wheels.sh cutedsl      -> .cute1/ .cute2/
#   ../shared/tools/device-wheels.sh flashinfer   -> .whl/ (carry only flashinfer's wheel: its
#                                                    apache-tvm-ffi comes with .cute2, and both
#                                                    wheels plus the tree are over 64 MiB)
# Then, in order:
#   a  (carry .cute1): unpack the CuTe DSL libraries; the core GPU tests (fused all-reduce, the
#      fused MoE finalize on 1 and 2 GPUs, parallel paths) and the feature matrix record
#   b  (carry .cute2): the CuTe DSL plugin (tests, conformance, its finalize variant), MHC
#      kernels, bench norm, bench finalize, bench mhc
#   c  (carry .whl):   FlashInfer: JIT builds beside bench decode, then its GPU tests and the
#      fused candidate in bench allreduce
# and for the MHC kernels (no carry):
#   e  the MHC GPU suite (MHC_SUITE_K: a pytest -k filter) beside a sweep of launch-shape variants
#      (the arguments after "e", each a quoted "NAME=VALUE ..."; "" the defaults) and ncu of the
#      stream pass
#   f  as e without ncu, the suite split over both GPUs
#   g  bench mhc (the dated record) beside variants at T = 1024 and 8192
#   h  variants with --coop at T = 8192 (the arguments after "h") on GPU 0; on GPU 1 the mid
#      bucket in the prefill shape at T = 128 to 1024, then the joined-pass tests
#   i  variants (the arguments after "i") at T = 128 to 8192 and two at H = 7168, then the
#      joined-pass tests on GPU 0; the rest of the MHC GPU suite on GPU 1
#   j  the finish's warps at H = 4096 and 7168, then the GPU tests a finish change touches, on
#      GPU 0; bench mhc (the dated record) on GPU 1
#   k  bench mhc at H = 7168 on GPU 1; the one-launch / two-launch tests on GPU 0
#   l  one GPU: decode and mid sizes (one launch and two) after the finish's dead-row skip, then
#      the tests it touches
#   u  (carry .cute1a, one GPU): the first part of the CuTe DSL libraries, kept for stage m
#      (split -b 42M .cute1/cu13.tar.xz into .cute1a/ and .cute1b/ first; a machine idle for
#      30 s is given back, so u and the next stage go one right after the other)
#   m  (carry .cute1b and .cute2, right after u): the rest, unpacked and installed; the MHC cluster
#      kernel's GPU tests, then as asked: its variants (MHC_CLUSTER_VARIANTS) beside the Triton two
#      launches, bench mhc (MHC_BENCH=1, the dated record), ncu of it (MHC_NCU), ncu's warp-stall
#      samples per SASS instruction of one variant (MHC_NCU_SASS)
#   p  as m, without the cluster kernel's suite (only the MHC_TESTS given, if any)
#   r  (carry .cute1b and .cute2, right after u; two GPUs): every GPU-marked test: the multi-GPU
#      files on both GPUs, then the rest split over the two (without FlashInfer unless installed);
#      R_MHC_ONLY=1: only the Triton MHC files, one a GPU (they take longer than one call holds)
#   s  (carry .cute1b and .cute2, right after u; two GPUs): every MHC GPU file (the CuTe DSL variants
#      and the Triton kernels; update+reads from cluster_ops.SPLIT_TOKENS = 1024 tokens run the split
#      variant), in one call: about 6 minutes
#   w  every GPU visible (4 or 8: the 4- and 8-GPU issue): the NCCL parallel matrix at 2, 4 and 8
#      ranks, bench allreduce --world N and bench decode --tp 1 2 N (dated records)
# Logs and results go to $OUT (the device tool brings them back).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage=${1:?stage a, b, c, e or f}
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/mhc -e plugins/flashinfer \
  -e plugins/cutedsl -e plugins/rocm_aiter >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
cute_env() {
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH} CUTE_DSL_ARCH=sm_90a
}
# After stage u: the CuTe DSL libraries from both parts (.cute1b carried now) and its wheels (.cute2).
cute_install() {
  [ -f /tmp/cute_parts/cu13part.aa ] || { echo "machine not warm: redo stage u"; exit 3; }
  mkdir -p /tmp/site && cat /tmp/cute_parts/cu13part.aa .cute1b/* | xz -T8 -dc | tar -xf - -C /tmp/site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 .cute2/*.whl \
    && cp -rn /tmp/site2/. /tmp/site/ 2>/dev/null || exit 1
  cute_env
}
versions() { python3 - <<'PY'
import torch, triton
def v(mod):
    try:
        return __import__(mod).__version__
    except Exception as e:
        return f"unavailable ({type(e).__name__})"
print(f"torch {torch.__version__} cuda {torch.version.cuda} triton {triton.__version__} "
      f"flashinfer {v('flashinfer')} cutlass-dsl {v('cutlass')} nccl {torch.cuda.nccl.version()}")
for i in range(torch.cuda.device_count()): print(torch.cuda.get_device_name(i))
PY
}
pt() { timeout "$1" python3 -m pytest -q -rs -p no:cacheprovider "${@:2}"; }
case "$stage" in
a)
  mkdir -p /tmp/site
  ( xz -T8 -dc .cute1/cu13.tar.xz | tar -xf - -C /tmp/site && touch /tmp/cute1_done ) > "$OUT/unpack.log" 2>&1 &
  versions | tee "$OUT/versions-a.txt"
  pt 260 -m gpu tests/gpu/test_fused_allreduce.py tests/gpu/test_moe_finalize_fusion.py tests/gpu/test_gpu_parallel.py \
    > "$OUT/a-core.log" 2>&1
  tail -4 "$OUT/a-core.log"
  # The feature matrix on NCCL (issue: MoE, TBO, branches, CP, SP, capture): a dated record.
  timeout 200 python3 benchmarks/gpu_feature_matrix.py --out "$OUT" > "$OUT/gpu-features.log" 2>&1
  tail -28 "$OUT/gpu-features.log"
  wait; ls /tmp/cute1_done && du -sh /tmp/site
  ;;
b)
  [ -f /tmp/cute1_done ] || { echo "machine not warm (or stage a's unpack failed): redo stage a"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 .cute2/*.whl \
    && cp -rn /tmp/site2/. /tmp/site/ || exit 1
  cute_env
  versions | tee "$OUT/versions-b.txt"
  layer-boundary plugins > "$OUT/plugins-b.txt" 2>&1; cat "$OUT/plugins-b.txt"
  # Two lanes: GPU 1 benchmarks norm kernels (cutedsl among them) then MHC; GPU 0 runs the tests.
  ( CUDA_VISIBLE_DEVICES=1 timeout 220 layer-boundary bench norm --out "$OUT" > "$OUT/bench-norm.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 100 layer-boundary bench mhc --tokens 1 128 1024 8192 --hidden 4096 \
      --ops update+read --out "$OUT" > "$OUT/bench-mhc.log" 2>&1 ) &
  CUDA_VISIBLE_DEVICES=0 pt 200 -m gpu tests/plugins/test_cutedsl_plugin.py tests/kit/test_vendor_conformance.py \
    tests/gpu/test_moe_finalize_fusion.py -k "cutedsl or Vendor" > "$OUT/b-cutedsl.log" 2>&1
  tail -6 "$OUT/b-cutedsl.log"
  CUDA_VISIBLE_DEVICES=0 pt 120 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py > "$OUT/b-mhc.log" 2>&1; tail -4 "$OUT/b-mhc.log"
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/sweeps/mhc_check.py --time > "$OUT/mhc-check.log" 2>&1
  tail -25 "$OUT/mhc-check.log"
  wait; tail -40 "$OUT/bench-norm.log"; tail -12 "$OUT/bench-mhc.log"
  timeout 130 layer-boundary bench finalize --quick --out "$OUT" > "$OUT/bench-finalize.log" 2>&1
  tail -30 "$OUT/bench-finalize.log"
  ;;
c)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fsite \
    .whl/flashinfer_python-*.whl || exit 1
  cute_env; export PYTHONPATH=$PYTHONPATH:/tmp/fsite
  versions | tee "$OUT/versions-c.txt"
  # FlashInfer's JIT builds (norm: under a minute; the trtllm all-reduce fusion: ~5 minutes) run
  # on the CPUs beside the decode bench, which leaves FlashInfer out while it is being built.
  ( python3 -c "
from flashinfer.jit.norm import gen_norm_module; gen_norm_module().build_and_load(); open('/tmp/fi_norm_done','w')
from flashinfer.jit.comm import gen_trtllm_comm_module; gen_trtllm_comm_module().build_and_load(); open('/tmp/fi_comm_done','w')
" > "$OUT/fi_jit.log" 2>&1 ) &
  LAYER_BOUNDARY_DISABLE=flashinfer,cutedsl timeout 300 layer-boundary bench decode --out "$OUT" \
    > "$OUT/bench-decode.log" 2>&1
  tail -30 "$OUT/bench-decode.log"
  for _ in $(seq 60); do [ -f /tmp/fi_comm_done ] && break; sleep 2; done
  tail -3 "$OUT/fi_jit.log"
  export LAYER_BOUNDARY_FLASHINFER_FUSION=1 LAYER_BOUNDARY_HANG_DUMP_S=60
  pt 120 -m gpu tests/plugins/test_flashinfer_gpu.py > "$OUT/c-flashinfer.log" 2>&1; tail -5 "$OUT/c-flashinfer.log"
  timeout 120 layer-boundary bench allreduce --quick --out "$OUT" > "$OUT/bench-allreduce.log" 2>&1
  tail -30 "$OUT/bench-allreduce.log"
  ;;
e)
  # MHC launch-shape variants (benchmarks/sweeps/mhc_variants.py) and ncu on the stream pass on
  # GPU 0, the MHC GPU suite on GPU 1 (two GPUs), one after the other on one.
  versions | tee "$OUT/versions-e.txt"
  two=$([ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && echo 1 || echo 0)
  suite() { CUDA_VISIBLE_DEVICES=$two pt 520 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py tests/plugins/test_mhc.py --durations=10 \
    ${MHC_SUITE_K:+-k "$MHC_SUITE_K"} > "$OUT/e-mhc-suite.log" 2>&1; }
  [ "$two" = 1 ] && suite &
  ( cd benchmarks/sweeps && export CUDA_VISIBLE_DEVICES=0
    [ $# -ge 2 ] && vs=("${@:2}") || vs=("")
    timeout 330 python3 mhc_variants.py "${vs[@]}" --coop --tokens 8192 > "$OUT/mhc-variants.log" 2>&1
    for v in "" "JOINED=0,0,1"; do
      timeout 90 ncu --clock-control none -k regex:mhc_boundary --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
        python3 mhc_variants.py "$v" --once --tokens 8192 > "$OUT/ncu-stream-$(echo "${v:-defaults}" | tr -c "A-Za-z0-9_\n" _).txt" 2>&1
    done )
  [ "$two" = 1 ] || suite
  wait; cat "$OUT/mhc-variants.log"; tail -15 "$OUT/e-mhc-suite.log"
  grep -h "Duration\|Issue Slots Busy\|Registers Per\|Achieved Occupancy\|Stall\|Memory Throughput" \
    "$OUT"/ncu-stream-*.txt | head -60
  ;;
f)
  # Two GPUs: the MHC GPU suite but the joined-pass cases on GPU 1; on GPU 0 the variants sweep
  # (the arguments after "f", as for e), then the joined-pass cases.
  versions | tee "$OUT/versions-f.txt"
  CUDA_VISIBLE_DEVICES=1 pt 540 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py tests/plugins/test_mhc.py -k "not joined_stream_pass" \
    --durations=5 > "$OUT/f-mhc-suite.log" 2>&1 &
  ( cd benchmarks/sweeps && [ $# -ge 2 ] && vs=("${@:2}") || vs=("")
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 mhc_variants.py "${vs[@]}" --coop --tokens 8192 \
      > "$OUT/mhc-variants.log" 2>&1 )
  CUDA_VISIBLE_DEVICES=0 pt 230 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py -k joined_stream_pass > "$OUT/f-joined.log" 2>&1
  wait; cat "$OUT/mhc-variants.log"; tail -3 "$OUT/f-joined.log"; tail -9 "$OUT/f-mhc-suite.log"
  ;;
g)
  # Two GPUs: the dated bench mhc record on GPU 1; variants (as for e) at T = 1024 and 8192 on GPU 0.
  versions | tee "$OUT/versions-g.txt"
  CUDA_VISIBLE_DEVICES=1 timeout 340 layer-boundary bench mhc --tokens 1 128 1024 8192 32768 --hidden 4096 7168 \
    --ops update+read --out "$OUT" > "$OUT/bench-mhc.log" 2>&1 &
  ( cd benchmarks/sweeps && [ $# -ge 2 ] && vs=("${@:2}") || vs=("")
    CUDA_VISIBLE_DEVICES=0 timeout 320 python3 mhc_variants.py "${vs[@]}" --tokens 1024 8192 \
      > "$OUT/mhc-variants.log" 2>&1 )
  wait; cat "$OUT/mhc-variants.log"; tail -32 "$OUT/bench-mhc.log"
  ;;
h)
  versions | tee "$OUT/versions-h.txt"
  ( cd benchmarks/sweeps
    CUDA_VISIBLE_DEVICES=1 timeout 250 python3 mhc_variants.py "" "MID_TOKENS=256" \
      "BLOCK_TOKENS=16,64,64 JOINED=0,1,1 JOINED_WARPS=8,4,4" --tokens 128 512 1024 > "$OUT/mhc-mid.log" 2>&1
    cd ../.. && CUDA_VISIBLE_DEVICES=1 pt 280 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py \
      -k "joined_stream_pass or folded_short_lag" > "$OUT/h-joined.log" 2>&1 ) &
  ( cd benchmarks/sweeps && [ $# -ge 2 ] && vs=("${@:2}") || vs=("")
    CUDA_VISIBLE_DEVICES=0 timeout 520 python3 mhc_variants.py "${vs[@]}" --coop --tokens 8192 \
      > "$OUT/mhc-variants.log" 2>&1 )
  wait; cat "$OUT/mhc-variants.log" "$OUT/mhc-mid.log"; tail -4 "$OUT/h-joined.log"
  ;;
i)
  versions | tee "$OUT/versions-i.txt"
  CUDA_VISIBLE_DEVICES=1 pt 560 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py tests/plugins/test_mhc.py \
    -k "not joined_stream_pass and not folded_short_lag" --durations=5 > "$OUT/i-mhc-suite.log" 2>&1 &
  ( cd benchmarks/sweeps && [ $# -ge 2 ] && vs=("${@:2}") || vs=("")
    export CUDA_VISIBLE_DEVICES=0
    timeout 200 python3 mhc_variants.py "${vs[@]}" --tokens 128 512 1024 8192 > "$OUT/mhc-variants.log" 2>&1
    timeout 100 python3 mhc_variants.py "" "MAX_TILE=4096" --hidden 7168 --tokens 8192 \
      > "$OUT/mhc-variants-7168.log" 2>&1 )
  CUDA_VISIBLE_DEVICES=0 pt 250 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py -k "joined_stream_pass or folded_short_lag" \
    > "$OUT/i-joined.log" 2>&1
  wait; cat "$OUT/mhc-variants.log" "$OUT/mhc-variants-7168.log"; tail -3 "$OUT/i-joined.log"
  tail -9 "$OUT/i-mhc-suite.log"
  ;;
j)
  versions | tee "$OUT/versions-j.txt"
  CUDA_VISIBLE_DEVICES=1 timeout 400 layer-boundary bench mhc --tokens 1 128 1024 8192 32768 --hidden 4096 7168 \
    --ops update+read --out "$OUT" > "$OUT/bench-mhc.log" 2>&1 &
  ( cd benchmarks/sweeps && export CUDA_VISIBLE_DEVICES=0
    for h in 7168 4096; do
      timeout 130 python3 mhc_variants.py "FINISH_WARPS=4" "FINISH_WARPS=8" "FINISH_WARPS=16" --hidden $h \
        --tokens 1024 8192 > "$OUT/mhc-finish-$h.log" 2>&1
    done )
  CUDA_VISIBLE_DEVICES=0 pt 150 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py \
    -k "(eager_matches_the_reference and 7168) or cuda_graph or compiled or folded_short_lag" > "$OUT/j-tests.log" 2>&1
  wait; cat "$OUT"/mhc-finish-*.log; tail -3 "$OUT/j-tests.log"; tail -32 "$OUT/bench-mhc.log"
  ;;
k)
  versions | tee "$OUT/versions-k.txt"
  CUDA_VISIBLE_DEVICES=1 timeout 300 layer-boundary bench mhc --tokens 1 128 1024 8192 32768 --hidden 7168 \
    --ops update+read --out "$OUT" > "$OUT/bench-mhc.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 pt 320 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py -rf \
    -k "(eager_matches_the_reference and 7168) or folded_short_lag or joined_stream_pass" > "$OUT/k-tests.log" 2>&1
  wait; tail -8 "$OUT/k-tests.log"; tail -8 "$OUT/bench-mhc.log"
  ;;
l)
  versions | tee "$OUT/versions-l.txt"
  ( cd benchmarks/sweeps && timeout 150 python3 mhc_variants.py "" --coop --tokens 1 16 128 1024 8192 \
      > "$OUT/mhc-variants.log" 2>&1 )
  pt 150 -m gpu tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py -rf \
    -k "(eager_matches_the_reference and bfloat16 and 4096) or cuda_graph or cooperative_ordering" > "$OUT/l-tests.log" 2>&1
  cat "$OUT/mhc-variants.log"; tail -4 "$OUT/l-tests.log"
  ;;
u)
  # The recompressed library (61 MiB) and the tree are over one call's 64 MiB: its first 42 MiB
  # (split -b 42M .cute1/cu13.tar.xz: .cute1a/ *.aa) wait here for stage m, which brings the rest.
  mkdir -p /tmp/cute_parts && cp .cute1a/* /tmp/cute_parts/ && echo "part 1 in place" || exit 1
  ;;
m|p)
  # p: as m without the cluster kernel's test suite (MHC_TESTS alone, if set).
  cute_install
  versions | tee "$OUT/versions-m.txt"
  # MHC_TESTS: more pytest arguments (files, -k) beside the cluster kernel's tests;
  # MHC_TESTS_TIMEOUT, MHC_VARIANTS_TIMEOUT: their limits in seconds (a variant that hangs costs no more).
  suite=tests/plugins/test_mhc_cluster.py; [ "$stage" = p ] && suite=
  if [ -n "$suite${MHC_TESTS:-}" ]; then
    eval "pt ${MHC_TESTS_TIMEOUT:-300} -m gpu $suite -rf ${MHC_TESTS:-}" > "$OUT/m-tests.log" 2>&1
    grep -E "^(FAILED|E  )" "$OUT/m-tests.log" | head -20
    tail -2 "$OUT/m-tests.log"
  fi
  # Cluster variants (MHC_CLUSTER_VARIANTS: quoted "NAME=VALUE ..." items of MhcKernelConfig fields;
  # MHC_VARIANT_ARGS: more arguments for the sweep, such as "--eager"; MHC_VARIANT_TOKENS: the
  # token counts, default 1024 8192) at H = 4096, then MHC_CLUSTER_VARIANTS_WIDE at H = 7168.
  if [ -n "${MHC_CLUSTER_VARIANTS:-}" ]; then
    ( cd benchmarks/sweeps && eval "timeout ${MHC_VARIANTS_TIMEOUT:-200} python3 mhc_cluster_variants.py $MHC_CLUSTER_VARIANTS --tokens ${MHC_VARIANT_TOKENS:-1024 8192} ${MHC_VARIANT_ARGS:-}" \
        > "$OUT/cluster-variants.log" 2>&1
      eval "timeout 120 python3 mhc_cluster_variants.py ${MHC_CLUSTER_VARIANTS_WIDE:-\"\"} --hidden 7168 --tokens 1024 8192" \
        >> "$OUT/cluster-variants.log" 2>&1 )
    cat "$OUT/cluster-variants.log"
  fi
  if [ -n "${MHC_BENCH:-}" ]; then  # bench mhc, the dated record, cluster kernel beside the Triton kernels
    timeout 200 layer-boundary bench mhc --tokens ${MHC_BENCH_TOKENS:-1 128 1024 8192 32768} --hidden 4096 --ops update+read read \
      --out "$OUT" > "$OUT/bench-mhc-4096.log" 2>&1; grep -v "^ *$" "$OUT/bench-mhc-4096.log" | tail -44
    [ -n "${MHC_BENCH_TOKENS:-}" ] || { mkdir -p "$OUT/h7168"; timeout 120 layer-boundary bench mhc --tokens 1024 8192 --hidden 7168 --ops update+read \
      --out "$OUT/h7168" > "$OUT/bench-mhc-7168.log" 2>&1; grep -v "^ *$" "$OUT/bench-mhc-7168.log" | tail -12; }
  fi
  if [ -n "${MHC_NCU:-}" ]; then  # ncu of the cluster kernel, T = 8192, each variant in MHC_NCU
    ( cd benchmarks/sweeps && eval "timeout 150 ncu --clock-control none -k regex:kernel_cutlass --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
        python3 mhc_cluster_variants.py $MHC_NCU --once --tokens 8192" > "$OUT/ncu-cluster.txt" 2>&1 )
    grep -v "^==PROF==\|^ *$\|----" "$OUT/ncu-cluster.txt" | cut -c1-110 | tail -150
  fi
  if [ -n "${MHC_NCU_SASS:-}" ]; then  # warp-stall samples per SASS instruction, T = 8192, one variant
    ( cd benchmarks/sweeps && eval "timeout 200 ncu --clock-control none -k regex:kernel_cutlass --launch-count 1 \
        --section WarpStateStats --section SourceCounters -f -o $OUT/cluster \
        python3 mhc_cluster_variants.py $MHC_NCU_SASS --once --tokens 8192" > "$OUT/ncu-sass.log" 2>&1 )
    ncu -i "$OUT/cluster.ncu-rep" --page source --csv --print-source sass > "$OUT/cluster-sass.csv" 2>>"$OUT/ncu-sass.log"
    tail -3 "$OUT/ncu-sass.log"; wc -l "$OUT/cluster-sass.csv"; head -3 "$OUT/cluster-sass.csv" | cut -c1-600
  fi
  ;;
r)
  cute_install
  versions | tee "$OUT/versions-r.txt"
  layer-boundary plugins > "$OUT/plugins-r.txt" 2>&1; cat "$OUT/plugins-r.txt"
  if [ -n "${R_MHC_ONLY:-}" ]; then  # the Triton MHC files alone, one a GPU (about 9 minutes)
    CUDA_VISIBLE_DEVICES=1 pt 540 -m gpu -rfs --durations=8 tests/plugins/test_mhc_launch_forms.py tests/plugins/test_mhc.py \
      > "$OUT/r-mhc1.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0 pt 540 -m gpu -rfs --durations=8 tests/plugins/test_mhc_kernels.py > "$OUT/r-mhc0.log" 2>&1
    wait; for f in r-mhc0 r-mhc1; do grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -20; tail -12 "$OUT/$f.log"; done
    exit 0
  fi
  multi="tests/gpu/test_gpu_parallel.py tests/gpu/test_fused_allreduce.py tests/gpu/test_moe_finalize_fusion.py tests/gpu/test_gpu_features.py"
  pt 200 -m gpu -rfs --durations=8 $multi > "$OUT/r-multi.log" 2>&1; tail -12 "$OUT/r-multi.log"
  one=$(ls tests/*/test_*.py | grep -v -e test_mhc -e test_triton_kernels -e test_gpu_parallel -e test_fused_allreduce \
    -e test_moe_finalize_fusion -e test_gpu_features)
  CUDA_VISIBLE_DEVICES=1 pt 330 -m gpu -rfs --durations=8 tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_launch_forms.py \
    tests/plugins/test_mhc.py > "$OUT/r-gpu1.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 pt 330 -m gpu -rfs --durations=8 tests/plugins/test_mhc_cluster.py tests/plugins/test_mhc_persistent.py \
    tests/unit/test_triton_kernels.py $one > "$OUT/r-gpu0.log" 2>&1
  wait; for f in r-gpu0 r-gpu1; do grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -20; tail -14 "$OUT/$f.log"; done
  ;;
s)
  cute_install
  versions | tee "$OUT/versions-s.txt"
  CUDA_VISIBLE_DEVICES=1 pt 540 -m gpu -rfs tests/plugins/test_mhc_launch_forms.py tests/plugins/test_mhc.py \
    tests/plugins/test_mhc_split.py > "$OUT/s-gpu1.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 pt 540 -m gpu -rfs tests/plugins/test_mhc_kernels.py tests/plugins/test_mhc_cluster.py \
    tests/plugins/test_mhc_persistent.py > "$OUT/s-gpu0.log" 2>&1
  wait; for f in s-gpu0 s-gpu1; do grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -20; tail -6 "$OUT/$f.log"; done
  ;;
w)
  versions | tee "$OUT/versions-w.txt"
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  pt 300 -m gpu tests/gpu/test_gpu_parallel.py -rs > "$OUT/w-parallel.log" 2>&1; tail -4 "$OUT/w-parallel.log"
  timeout 300 layer-boundary bench allreduce --world "$n" --quick --out "$OUT" > "$OUT/bench-allreduce.log" 2>&1
  tail -30 "$OUT/bench-allreduce.log"
  timeout 300 layer-boundary bench decode --tp 1 2 "$n" --quick --out "$OUT" > "$OUT/bench-decode.log" 2>&1
  tail -30 "$OUT/bench-decode.log"
  ;;
esac
