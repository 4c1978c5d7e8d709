#!/usr/bin/env bash
# A real build of the CUDA extension gafused._C, on a machine without a GPU:
#
#   bash bench/cuda_build_check.sh
#
# 1. A virtualenv with a CUDA build of torch (torch==2.14.1, built for CUDA 13.0; ~5.5 GB), made once and reused
#    while it holds that torch: $GAFUSED_CUDA_VENV, default ~/.cache/gafused/venv-torch-2.14.1.
# 2. A copy of this work tree, built there with the project's own setup.py, the way the README says:
#    GAFUSED_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=2 pip install --no-build-isolation --no-deps -e .
#    One architecture and two jobs keep it to a few minutes on 2 cores (set TORCH_CUDA_ARCH_LIST for others).
# 3. In that virtualenv: gafused._C imports; every op of it refuses CPU tensors with a message naming the
#    argument (tests/test_cuda_ops.py); its SASS has 128-bit accesses on every stream (tests/test_cuda_build.py).
#
# Needs nvcc and free disk (8 GiB for a new virtualenv, 2 GiB to reuse one). Without either it prints
# "SKIPPED: <why>" and exits 0, so CI can call it on any machine; any other failure exits non-zero.
# The copy is built under a temporary directory that is removed at the end; the virtualenv is kept
# (rm -r "$GAFUSED_CUDA_VENV" frees its space).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
torch_version="${GAFUSED_CUDA_TORCH:-2.14.1}"
venv="${GAFUSED_CUDA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gafused/venv-torch-$torch_version}"
python="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-2}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
start=$SECONDS

skip() {
  echo "SKIPPED: CUDA build check: $*"
  exit 0
}
step() {
  echo "== cuda build check: $* (at $((SECONDS - start)) s)"
}

free_gib() {  # free space of the filesystem holding $1 (or its nearest existing parent), in GiB
  local path=$1
  while [ ! -e "$path" ]; do path=$(dirname "$path"); done
  df -Pk "$path" | awk 'NR == 2 { print int($4 / 1048576) }'
}

venv_ready() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$torch_version" <<'EOF' >/dev/null 2>&1
import sys

import torch

assert torch.__version__.split("+")[0] == sys.argv[1] and torch.version.cuda is not None
EOF
}

command -v nvcc >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] ||
  skip "nvcc not found (put it on PATH or set CUDA_HOME)"

if venv_ready; then
  need_gib=2
else
  need_gib=8
fi
tmp_parent="${TMPDIR:-/tmp}"
for place in "$venv" "$tmp_parent"; do
  have=$(free_gib "$place")
  [ "$have" -ge "$need_gib" ] || skip "$have GiB free under $place, need $need_gib GiB"
done

if venv_ready; then
  step "reusing $venv"
else
  step "creating $venv with torch==$torch_version (CUDA build)"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "torch==$torch_version" numpy setuptools wheel ninja pytest
  venv_ready || { echo "torch==$torch_version in $venv is not a CUDA build" >&2; exit 1; }
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

work=$(mktemp -d "$tmp_parent/gafused-cuda-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
step "copying the work tree to $work/src"
mkdir "$work/src"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Tracked and untracked-but-not-ignored files: what is being checked, without build outputs.
  git -C "$repo" ls-files -z --cached --others --exclude-standard | (cd "$repo" && xargs -0 tar -cf - --) |
    tar -xf - -C "$work/src"
else
  tar -cf - --exclude=./build --exclude='*.so' --exclude='*.egg-info' . | tar -xf - -C "$work/src"
fi

step "building gafused._C (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
build_start=$SECONDS
(cd "$work/src" && GAFUSED_FORCE_CUDA=1 "$venv/bin/python" -m pip install -v --no-build-isolation --no-deps -e . \
  >"$work/build.log" 2>&1) || {
  tail -40 "$work/build.log"
  echo "== first errors:" && grep -m 20 -iE "error|FAILED" "$work/build.log"
  echo "build failed" >&2
  exit 1
}
build_s=$((SECONDS - build_start))
{ grep -oE "arch=compute_[0-9]+,code=[^ ]*sm_[0-9]+" "$work/build.log" || true; } | sort -u |
  sed 's/^/built for /'

step "importing the extension and checking it"
cd "$work/src"
"$venv/bin/python" - <<'EOF'
import torch

import gafused
from gafused import _C

print("gafused._C:", _C.__file__)
print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPU visible:", torch.cuda.is_available())
print("backends on cpu:", gafused.available_backends("cpu"))
EOF
"$venv/bin/python" -m pytest -q -p no:cacheprovider -rs \
  tests/test_cuda_ops.py tests/test_cuda_build.py::test_built_extension_uses_128_bit_global_accesses |
  tee "$work/pytest.log"
# Those tests skip when the extension does not load; here it must have loaded, so a skip of them is a failure.
if grep -E "SKIPPED.*(gafused\._C is not built|does not load)" "$work/pytest.log"; then
  echo "the built extension was not exercised (see SKIPPED above)" >&2
  exit 1
fi
echo "cuda build check passed: build ${build_s} s, total $((SECONDS - start)) s"
