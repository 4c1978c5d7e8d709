#!/usr/bin/env bash
# The phase_* functions and their helpers are called indirectly (by name, or in `timeout bash -c`).
# shellcheck disable=SC2317
#
# Everything gafused checks on a CUDA machine, for one with no network and no pip: a CUDA build of torch,
# triton, nvcc and pytest preinstalled (matplotlib optional: without it no PNGs are drawn).
#
#   bash bench/gpu_check.sh all        # env, build, sanitize, tests, within $GPU_CHECK_BUDGET_S (570 s)
#   bash bench/gpu_check.sh env        # versions, the GPU, the tools found
#   bash bench/gpu_check.sh build      # build gafused._C in place with setup.py (GAFUSED_FORCE_CUDA=1)
#   bash bench/gpu_check.sh tests      # the whole suite (cuda vs reference, triton compiled for real, 2^31 tests)
#   bash bench/gpu_check.sh sanitize   # compute-sanitizer memcheck and racecheck over the CUDA op tests
#   bash bench/gpu_check.sh kernels    # the 256 MB..4 GB kernel sweep against copy bandwidth
#   bash bench/gpu_check.sh windows    # whole windows (GPT-2, LLaMA-7B shapes, bf16 grads, N = 8), end to end, memory
#   bash bench/gpu_check.sh configs    # kernels alone vs with host work; the Triton folds' block sizes and warps
#   bash bench/gpu_check.sh profile    # one end-to-end window of each accumulation recipe under torch.profiler
#   bash bench/gpu_check.sh host       # host work of a middle micro-step, GPT-2's 148 gradients, every backend
#   bash bench/gpu_check.sh bench      # the full benchmark, bf16 grads: every set, end to end, the kernel sweep
#   bash bench/gpu_check.sh bench_fp32 # the rest of the full benchmark: every set with fp32 grads
#
# Several phases may be named in one call (bash bench/gpu_check.sh kernels configs). `all` is env, build, sanitize
# and tests, in that order: the sanitizer's 200 s cap fits after env's and build's whole caps, and the suite gets
# what is left of the budget (about 365 s after the 184 s the other three took on an H200), which may cut it
# off: it took more than 300 s there. `bash bench/gpu_check.sh build tests` gives it its 480 s. Phases after
# `build` use the extension it built in place (gafused/_C*.so), so a later call in the same tree may skip `build`
# (a phase that needs the extension and finds none builds it first).
# Every phase gets its own time limit (phase_cap below) or what is left of $GPU_CHECK_BUDGET_S less the grace
# period, whichever is less, and no phase starts with less than 20 s. At its limit `timeout` sends the phase
# SIGTERM, and SIGKILL $GPU_CHECK_GRACE_S (20) s later: the benchmark scripts use that time to write what they have
# measured, marked partial, and the phase's log keeps every line its program printed. Limit and grace together
# stay within the budget, so one call fits a 10-minute session.
#
# The full benchmark (python bench/run.py --full) is two phases, `bench` and `bench_fp32`: the whole of it,
# estimated at 600-800 s on an H200 (from the 253 s of `windows` there: two sets, one dtype, five providers), does
# not fit one phase. Neither half has been timed on a GPU yet; a half stopped by its limit keeps what it measured.
#
# Logs and results go to $OUT when it is set, else bench/results/gpu-check; the summary table is printed last
# and kept as summary.txt beside them. Exit status: 0 when every phase passed or was skipped for a missing tool
# (compute-sanitizer), 1 when one failed or timed out, 3 when the budget ran out before a phase.
# Sourced (`source bench/gpu_check.sh`), it defines the phases and helpers and runs nothing (the tests use that).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
repo=$(pwd)
out="${OUT:-bench/results/gpu-check}"
# Absolute (the phases run in child shells), but not created yet: a call that is refused (an unknown phase) leaves
# nothing behind. main and run_phase create it.
[[ "$out" == /* ]] || out="$repo/$out"
python="${PYTHON:-python3}"
budget_s="${GPU_CHECK_BUDGET_S:-570}"
grace_s="${GPU_CHECK_GRACE_S:-20}"
# Run from the work tree without installing it (there may be no pip): bench/run.py imports gafused too.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS
summary=()

# Time limit of each phase, seconds. The suite took more than 300 s on an H200 with 8 workers: it gets most.
declare -A phase_cap=([env]=30 [build]=240 [tests]=480 [sanitize]=200 [kernels]=150 [windows]=400 [configs]=150
  [profile]=150 [host]=90 [bench]=540 [bench_fp32]=540)

log() { echo "$out/gpu-$1.log"; }

# The end of a phase's pipeline: all of the output into log $1, its last $2 lines on screen. It ignores SIGTERM,
# which `timeout` sends to the phase's whole process group at the limit, so what the stopped program prints while
# it writes its partial results (its `wrote` line) still reaches the log and the screen.
log_tail() {
  trap '' TERM
  tee "$1" | tail -n "$2"
}

find_tool() {  # the path of CUDA tool $1: PATH, $CUDA_HOME, the toolkit nvcc reports, /usr/local/cuda*
  local name=$1 dir top
  command -v "$name" 2>/dev/null && return 0
  top=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/.*TOP=\([^ ]*\).*/\1/p' | head -1)
  for dir in "${CUDA_HOME:-}" "$top" /usr/local/cuda /usr/local/cuda-*; do
    [ -n "$dir" ] || continue
    for path in "$dir/bin/$name" "$dir/$name/$name"; do
      [ -x "$path" ] && { echo "$path"; return 0; }
    done
  done
  return 1
}

have_matplotlib() { "$python" -c "import matplotlib" >/dev/null 2>&1; }

# --- phases: each returns 0 (passed), 77 (skipped, reason on the last line of its log) or another failure code.

phase_env() {
  # Fails when torch does not import, is not a CUDA build, sees no GPU or cannot run a kernel on it.
  {
    local status=0
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)  cores: $(nproc)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$python" - <<'EOF' || status=1
import platform
import sys

import torch

print("python", platform.python_version(), "torch", torch.__version__, "CUDA", torch.version.cuda)
print("GPU:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none visible")
cuda_ok = torch.version.cuda is not None and torch.cuda.is_available()
if not cuda_ok:
    print("env: FAILED: torch is not a CUDA build or sees no GPU")
else:
    try:
        cuda_ok = torch.ones(1024, device="cuda").sum().item() == 1024
    except RuntimeError as error:
        cuda_ok = False
        print("env: FAILED: a kernel did not run on the GPU:", error)
try:
    import triton

    print("triton", triton.__version__)
except ImportError as error:
    print("triton: not importable:", error)
for name in ("transformers", "xdist", "matplotlib"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "importable"))
    except ImportError:
        print(name, "not importable")
sys.exit(0 if cuda_ok else 1)
EOF
    echo "nvcc: $(command -v nvcc || echo missing) $(nvcc --version 2>/dev/null | tail -1)"
    echo "compute-sanitizer: $(find_tool compute-sanitizer || echo 'not found')"
    exit "$status"
  } 2>&1 | log_tail "$(log env)" 40
  return "${PIPESTATUS[0]}"
}

phase_build() {
  # Forced, so a machine whose torch sees no GPU still builds; TORCH_CUDA_ARCH_LIST defaults to the visible GPU.
  rm -f gafused/_C*.so
  if ! "$python" -c "import setuptools" >/dev/null 2>&1; then
    # torch.utils.cpp_extension imports it too: without it no torch extension builds, by any route.
    echo "setuptools is not importable by $python: gafused._C cannot be built here" | tee "$(log build)"
    return 1
  fi
  GAFUSED_FORCE_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$python" setup.py build_ext --inplace >"$(log build)" 2>&1 ||
    { tail -40 "$(log build)"; grep -m 20 -iE "error|FAILED" "$(log build)"; return 1; }
  "$python" -c "import gafused; from gafused import _C; print('gafused._C:', _C.__file__); \
print('backends:', gafused.available_backends())" 2>&1 | tee -a "$(log build)"
  return "${PIPESTATUS[0]}"
}

phase_tests() {
  # With pytest-xdist (the GPU machines have it), files run in 8 workers, and a test that crashes its process
  # (a segfault in an extension) fails alone: xdist replaces the worker and the rest of the suite still runs.
  local parallel=()
  "$python" -c "import xdist" >/dev/null 2>&1 && parallel=(-n 8 --dist loadfile)
  # -v names every test as it ends, so a run cut off by its time limit still says which ones failed; a test still
  # running after 200 s has every thread's stack written to the log (pytest's faulthandler), so a hang says where.
  "$python" -m pytest tests -v -rfEs --durations=15 -o faulthandler_timeout=200 "${parallel[@]}" \
    --junitxml="$out/gpu-tests.xml" 2>&1 | {
    trap '' TERM  # as in log_tail: the log keeps every line pytest wrote before its time limit
    tee "$(log tests)" | grep -vE " (PASSED|SKIPPED) " | tail -60
  }
  return "${PIPESTATUS[0]}"
}

phase_sanitize() {
  local sanitizer status=0
  sanitizer=$(find_tool compute-sanitizer) || {
    echo "compute-sanitizer not found (PATH, \$CUDA_HOME, nvcc's toolkit, /usr/local/cuda*)" | tee "$(log sanitize)"
    return 77
  }
  : >"$(log sanitize)"
  # The 2^31-element test allocates 8 GiB, which the tools make slow; Triton is not what is checked here.
  local tests=(tests/test_cuda_ops.py -q -p no:cacheprovider -k "not int32 and not triton")
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool" | tee -a "$(log sanitize)"
    "$sanitizer" --tool "$tool" --error-exitcode 3 "$python" -m pytest "${tests[@]}" 2>&1 | {
      trap '' TERM
      tee -a "$(log sanitize)" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" | tail -3
    }
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  return "$status"
}

plots_flag() { have_matplotlib || echo "--no-plots"; }

phase_kernels() {
  # shellcheck disable=SC2046 # an empty flag must vanish
  "$python" bench/run.py --device cuda --kernels-only --out "$out" $(plots_flag) 2>&1 |
    log_tail "$(log kernels)" 45
  return "${PIPESTATUS[0]}"
}

phase_windows() {
  # The issue's whole-window comparison: bf16 gradients into fp32 buffers, N = 8, the five ways it is done.
  # shellcheck disable=SC2046
  "$python" bench/run.py --device cuda --full --sets gpt2-124m,llama-7b --dtypes bf16 --accumulation-steps 8 \
    --no-kernels --providers naive,foreach,compiled,gafused-triton,gafused-cuda --out "$out" $(plots_flag) 2>&1 |
    log_tail "$(log windows)" 60
  return "${PIPESTATUS[0]}"
}

phase_configs() {
  "$python" bench/kernel_configs.py --out "$out" 2>&1 | log_tail "$(log configs)" 60
  return "${PIPESTATUS[0]}"
}

phase_profile() {
  "$python" bench/e2e_profile.py --device cuda --out "$out" 2>&1 | log_tail "$(log profile)" 60
  return "${PIPESTATUS[0]}"
}

phase_host() {
  # Host work per middle micro-step at GPT-2's gradient count (bf16, small tensors: the kernels are negligible):
  # gafused's Python plus Triton's launcher, against torch._foreach_add_ of the bf16 gradients into fp32 (mixed
  # dtypes: torch's fallback, a kernel per tensor) and, row `same dtype`, of fp32 gradients (one kernel).
  "$python" bench/host_overhead.py --device cuda --tensors 148 --numel 4096 --dtype bf16 --reps 500 2>&1 |
    log_tail "$(log host)" 24
  return "${PIPESTATUS[0]}"
}

phase_bench() {
  # python bench/run.py --full with bf16 gradients: memory, correctness, every set, end to end, the kernel sweep.
  # shellcheck disable=SC2046
  "$python" bench/run.py --device cuda --full --dtypes bf16 --out "$out" $(plots_flag) 2>&1 |
    log_tail "$(log bench)" 80
  return "${PIPESTATUS[0]}"
}

phase_bench_fp32() {
  # The rest of python bench/run.py --full: every set with fp32 gradients (memory and correctness run again).
  # shellcheck disable=SC2046
  "$python" bench/run.py --device cuda --full --dtypes fp32 --no-e2e --no-kernels --out "$out" $(plots_flag) 2>&1 |
    log_tail "$(log bench_fp32)" 60
  return "${PIPESTATUS[0]}"
}

# What a phase's log says in one line, for the summary table.
detail_of() {
  local phase=$1 file
  file=$(log "$phase")
  [ -f "$file" ] || return 0
  case "$phase" in
    env) grep -m 1 "^GPU:" "$file" ;;
    build) grep -m 1 "^backends:" "$file" ;;
    tests) grep -E "[0-9]+ (passed|failed|errors?|skipped)" "$file" | tail -1 | tr -d '=' | sed 's/^ *//' ;;
    sanitize) grep -E "ERROR SUMMARY|RACECHECK SUMMARY|not found" "$file" | sed -E 's/^=+ *//' | paste -sd ';' ;;
    host) grep -E "^(step |PARTIAL)" "$file" | awk '/^PARTIAL/ {print "partial"; next} {print $2 " " $(NF-1) "x"}' |
      paste -sd ';' ;;
    kernels | bench | bench_fp32 | windows | configs | profile)
      grep -E "^wrote " "$file" | tail -1 | sed -E 's|[^ ,]*/||g' ;;
  esac
}

run_phase() {  # run_phase NAME LIMIT_S (0: no limit)
  local phase=$1 limit=$2 status began=$SECONDS
  mkdir -p "$out" || return 1
  echo "== $phase$([ "$limit" -gt 0 ] && echo " (limit ${limit} s)")"
  if [ "$limit" -gt 0 ]; then
    # timeout signals the phase's whole process group (pytest, the sanitizer and their children): SIGTERM at the
    # limit, SIGKILL $grace_s s later. On SIGTERM the phase's shell waits for its running pipeline (a stopped
    # benchmark writes its partial results meanwhile), then exits: nothing after it in the phase starts.
    timeout -k "$grace_s" "$limit" bash -c "trap 'exit 143' TERM; phase_$phase"
    status=$?
    [ "$status" -eq 137 ] && status=124
  else
    "phase_$phase"
    status=$?
  fi
  local word
  case "$status" in
    0) word=passed ;;
    77) word=skipped ;;
    124) word="TIMED OUT" ;;
    *) word="FAILED ($status)" ;;
  esac
  summary+=("$(printf '%-10s %-12s %5d s  %s' "$phase" "$word" $((SECONDS - began)) "$(detail_of "$phase")")")
  printf '%s\n' "${summary[@]}" >"$out/summary.txt"
  echo "== $phase: $word"
  [ "$status" -eq 0 ] || [ "$status" -eq 77 ]
}

# Phases run under `timeout` in a child bash: it needs the functions and settings.
export out python
export -f log log_tail find_tool have_matplotlib plots_flag phase_env phase_build phase_tests phase_sanitize \
  phase_kernels phase_windows phase_configs phase_profile phase_host phase_bench phase_bench_fp32

# The phases of a call, in order, on one line: `all` is env, build, sanitize, tests; without a build named, one
# goes before the first phase that uses the extension when the tree has none. An unknown phase is refused.
plan() {
  local phases=("$@") i phase
  [ "${#phases[@]}" -gt 0 ] || phases=(all)
  [ "${phases[*]}" != all ] || phases=(env build sanitize tests)
  for phase in "${phases[@]}"; do
    if [ -z "${phase_cap[$phase]+known}" ]; then  # every phase has a time limit
      echo "unknown phase '$phase': all, env, build, tests, sanitize, kernels, windows, configs, profile, host," \
        "bench, bench_fp32" >&2
      return 2
    fi
  done
  if [[ " ${phases[*]} " != *" build "* ]] && ! compgen -G "gafused/_C*.so" >/dev/null; then
    for i in "${!phases[@]}"; do
      case "${phases[$i]}" in
        env) ;;  # the only phase besides build that does not use the extension
        *)
          phases=("${phases[@]:0:$i}" build "${phases[@]:$i}")
          break
          ;;
      esac
    done
  fi
  echo "${phases[*]}"
}

# The time limit of phase $1 with $2 s of the budget left: its cap, or what is left less the grace period (so a
# SIGKILL at the end of the grace still falls within the budget), whichever is less.
phase_limit() {
  local cap=${phase_cap[$1]} left=$(($2 - grace_s))
  echo $((left < cap ? left : cap))
}

main() {
  local planned phase left limit failed=0
  local -a phases
  planned=$(plan "$@") || exit 2
  read -ra phases <<<"$planned"
  mkdir -p "$out" || exit 1
  # A phase that could not get a useful slice (20 s) is reported as not run. The build must pass for the later
  # phases to mean anything.
  for phase in "${phases[@]}"; do
    left=$((budget_s - (SECONDS - start)))
    limit=$(phase_limit "$phase" "$left")
    if [ "$limit" -lt 20 ]; then
      summary+=("$(printf '%-10s %-12s %5d s  %s' "$phase" "not run" 0 "budget of $budget_s s spent")")
      [ "$failed" -ne 0 ] || failed=3
      continue
    fi
    run_phase "$phase" "$limit" || {
      failed=1
      if [ "$phase" = build ]; then
        summary+=("$(printf '%-10s %-12s %5d s  %s' "later" "not run" 0 "the build failed")")
        break
      fi
    }
  done

  printf '%s\n' "${summary[@]}" >"$out/summary.txt"
  echo
  echo "== gafused GPU check: summary ($((SECONDS - start)) s; logs and results in $out)"
  printf '%-10s %-12s %7s  %s\n' phase status time detail
  printf '%s\n' "${summary[@]}"
  exit "$failed"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
