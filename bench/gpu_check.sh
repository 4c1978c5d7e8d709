#!/usr/bin/env bash
# Everything gafused checks on a CUDA machine, in phases that each fit one short session on it:
#
#   bash bench/gpu_check.sh build      # build gafused._C in place (ninja), print the backends
#   bash bench/gpu_check.sh tests      # the whole suite on the GPU (cuda vs reference, triton compiled for real)
#   bash bench/gpu_check.sh sanitize   # compute-sanitizer memcheck over the CUDA backend's op tests
#   bash bench/gpu_check.sh kernels    # the 256 MB..4 GB kernel sweep against copy bandwidth
#   bash bench/gpu_check.sh bench      # the full benchmark (micro sets, end to end, kernel sweep)
#   bash bench/gpu_check.sh all        # build, tests, kernels (default)
#
# Results go to $OUT when it is set, else bench/results; one log per phase beside them. Each phase after
# `build` expects the extension built in place by an earlier `build` in the same tree.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
status=0

run_phase() {
  local phase=$1
  echo "== $phase"
  case "$phase" in
    build)
      MAX_JOBS="${MAX_JOBS:-16}" "$python" -m pip install --no-build-isolation --no-deps --no-index -e . \
        >"$out/gpu-build.log" 2>&1 || { tail -40 "$out/gpu-build.log"; return 1; }
      "$python" -c "import torch, gafused; print(torch.__version__, torch.cuda.get_device_name(), \
'backends:', gafused.available_backends())" 2>&1 | tee -a "$out/gpu-build.log"
      ;;
    tests)
      "$python" -m pytest tests -q -rs 2>&1 | tee "$out/gpu-tests.log" | tail -25
      return "${PIPESTATUS[0]}"
      ;;
    sanitize)
      # The int32-offset test allocates 8 GiB, which memcheck makes slow; every other CUDA op test runs.
      compute-sanitizer --tool memcheck --error-exitcode 3 \
        "$python" -m pytest tests/test_cuda_ops.py -q -k "not int32" 2>&1 | tee "$out/gpu-memcheck.log" | tail -25
      return "${PIPESTATUS[0]}"
      ;;
    kernels)
      "$python" bench/run.py --full --kernels-only --out "$out" 2>&1 | tee "$out/gpu-kernels.log" | tail -45
      return "${PIPESTATUS[0]}"
      ;;
    bench)
      "$python" bench/run.py --full --out "$out" 2>&1 | tee "$out/gpu-bench.log" | tail -80
      return "${PIPESTATUS[0]}"
      ;;
    *)
      echo "unknown phase '$phase': build, tests, sanitize, kernels, bench or all" >&2
      return 2
      ;;
  esac
}

phases=("${@:-all}")
[ "${phases[0]}" = all ] && phases=(build tests kernels)
for phase in "${phases[@]}"; do
  run_phase "$phase" || { status=1; echo "== $phase FAILED"; }
done
exit "$status"
