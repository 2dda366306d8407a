#!/usr/bin/env bash
# Creates or reuses the project's virtual environment and installs flowtrain with its dev extras.
# Keeps a torch that is already installed (a GPU user's CUDA build); on a machine without a GPU it
# installs the CPU build of torch rather than letting pip pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
CPU_TORCH_VERSION="${FLOWTRAIN_CPU_TORCH_VERSION:-2.13.0}"
CPU_TORCH_INDEX="${FLOWTRAIN_CPU_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: reusing the torch installed for $PYTHON ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# Prints the path of a CPU build of torch that pip can take from local files (find-links),
# without asking any index; fails when there is none.
cpu_torch_wheel() {
  local dir
  dir=$(mktemp -d)
  "${PIP[@]}" download --no-deps --no-index -q -d "$dir" "torch==$CPU_TORCH_VERSION" \
    >/dev/null 2>&1 || return 1
  ls "$dir"/torch-*+cpu-*.whl 2>/dev/null | head -n 1 | grep . || return 1
}

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch from the package index"
    "${PIP[@]}" install torch
  elif local_wheel=$(cpu_torch_wheel); then
    # pip's find-links hold the CPU build: install that file; its dependencies come from the
    # index as usual.
    echo "setup: installing the CPU build of torch from local files ($(basename "$local_wheel"))"
    "${PIP[@]}" install "$local_wheel"
    rm -rf "$(dirname "$local_wheel")"
  else
    echo "setup: no GPU, installing the CPU build of torch from $CPU_TORCH_INDEX"
    "${PIP[@]}" install "torch==$CPU_TORCH_VERSION" --index-url "$CPU_TORCH_INDEX"
  fi
fi

"${PIP[@]}" install -q -e '.[dev]'
"$VENV/bin/python" -c "import torch, flowtrain; print(f'setup: flowtrain {flowtrain.__version__} with torch {torch.__version__} in $VENV')"
