#!/usr/bin/env bash
# Installs DeepSpeed (default 0.19.8) into the project's virtual environment for
# benchmarks/zero_vs_deepspeed.py, without touching the torch already there: the sdist is built
# with DS_BUILD_OPS=0 (ops are compiled just in time), --no-build-isolation and --no-deps, and
# only DeepSpeed's missing small pure-Python requirements are installed, each with --no-deps.
# Then it builds the CPU ops the benchmark uses (fused_adam, cpu_adam, deepspeed_shm_comm) once,
# so the first benchmark run does not time a compiler; PREBUILD=0 skips that (needs g++).
# Idempotent: a second run only checks. DeepSpeed is not a flowtrain dependency.
#
#   scripts/install_deepspeed.sh            # VENV=.venv DS_VERSION=0.19.8 DS_SDIST=path PREBUILD=1
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
DS_VERSION="${DS_VERSION:-0.19.8}"
DS_SDIST="${DS_SDIST:-/tmp/dsdl/deepspeed-$DS_VERSION.tar.gz}"
PREBUILD="${PREBUILD:-1}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
# DeepSpeed's requirements besides torch (pip show deepspeed: Requires).
DEPS=(einops hjson msgpack ninja numpy packaging psutil py-cpuinfo pydantic tqdm)

[ -x "$PY" ] || { echo "install_deepspeed: no $PY; run scripts/setup.sh first" >&2; exit 1; }
version_of() { "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"; }

torch_before=$(version_of torch)
[ -n "$torch_before" ] || { echo "install_deepspeed: torch is not installed in $VENV" >&2; exit 1; }

if [ "$(version_of deepspeed)" = "$DS_VERSION" ]; then
  echo "install_deepspeed: deepspeed $DS_VERSION already installed"
else
  # The build runs in this venv (--no-build-isolation): its setuptools needs bdist_wheel, which
  # setuptools >= 70.1 has and older ones take from the wheel package.
  if ! "$PY" -c "import setuptools.command.bdist_wheel" >/dev/null 2>&1 &&
     ! "$PY" -c "import wheel" >/dev/null 2>&1; then
    echo "install_deepspeed: this venv's setuptools has no bdist_wheel; installing wheel"
    "${PIP[@]}" install --no-deps wheel
  fi
  if [ ! -f "$DS_SDIST" ]; then
    mkdir -p "$(dirname "$DS_SDIST")"
    "${PIP[@]}" download --no-deps --no-build-isolation --no-binary :all: \
      -d "$(dirname "$DS_SDIST")" "deepspeed==$DS_VERSION"
  fi
  echo "install_deepspeed: installing $DS_SDIST (DS_BUILD_OPS=0, --no-deps)"
  DS_BUILD_OPS=0 "${PIP[@]}" install --no-build-isolation --no-deps "$DS_SDIST"
fi

missing=()
for dep in "${DEPS[@]}"; do
  [ -n "$(version_of "$dep")" ] || missing+=("$dep")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deepspeed: installing missing requirements (--no-deps): ${missing[*]}"
  "${PIP[@]}" install --no-deps "${missing[@]}"
fi

torch_after=$(version_of torch)
if [ "$torch_after" != "$torch_before" ]; then
  echo "install_deepspeed: torch changed from $torch_before to $torch_after; reinstall it" >&2
  exit 1
fi
"${PIP[@]}" check || echo "install_deepspeed: pip check reports the problems above" >&2

if [ "$PREBUILD" = 1 ]; then
  if ! command -v g++ >/dev/null 2>&1; then
    echo "install_deepspeed: no g++, DeepSpeed's CPU ops cannot be built; run the benchmark" \
         "with --torch-adam" >&2
  else
    echo "install_deepspeed: building DeepSpeed's CPU ops (cached under ~/.cache/torch_extensions)"
    DS_ACCELERATOR=cpu "$PY" - <<'EOF'
from deepspeed.accelerator import get_accelerator

acc = get_accelerator()
for name in ("FusedAdamBuilder", "CPUAdamBuilder", "ShareMemCommBuilder"):
    acc.create_op_builder(name).load()
    print(f"install_deepspeed: {name} ready")
EOF
  fi
fi
echo "install_deepspeed: deepspeed $(version_of deepspeed), torch $torch_after"
