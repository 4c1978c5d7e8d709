#!/usr/bin/env bash
# The ahead-of-time Triton check (tests/test_triton_aot.py) with the Triton of the GPU machines as well.
#
#   bash bench/triton_aot_check.sh            # Triton $TRITON_VERSION (default 3.6.0) beside the installed one
#
# A virtualenv that sees this machine's packages (torch, pytest) gets its own Triton, kept in
# ~/.cache/gafused/venv-triton-<version> for later runs; then every kernel variant is compiled for sm_80 and
# sm_90 by that Triton and checked (128-bit full-block accesses, no fma, no spills). No GPU needed.
# Prints SKIPPED and why when the Triton wheel cannot be installed, and exits 0 then.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${TRITON_VERSION:-3.6.0}"
venv="${GAFUSED_TRITON_VENV:-$HOME/.cache/gafused/venv-triton-$version}"
python="${PYTHON:-python}"

if ! "$venv/bin/python" -c "import triton, sys; sys.exit(triton.__version__ != '$version')" 2>/dev/null; then
  rm -rf "$venv"
  "$python" -m venv --system-site-packages "$venv"
  if ! "$venv/bin/python" -m pip install -q "triton==$version"; then
    echo "triton AOT check: SKIPPED (triton==$version could not be installed)"
    exit 0
  fi
fi
echo "triton AOT check: $("$python" -c 'import triton; print(triton.__version__)') and $("$venv/bin/python" -c 'import triton; print(triton.__version__)')"
# The installed Triton was checked by the test suite already: only the other version runs here.
GAFUSED_AOT_PYTHONS="$venv/bin/python" "$python" -m pytest tests/test_triton_aot.py -q -p no:cacheprovider -k "not this-python"
