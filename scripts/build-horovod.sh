#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 for the installed torch, with MPI and Gloo.
#
#   scripts/build-horovod.sh
#
# Horovod 0.28.1 (its last release) forces C++14, and torch 2.x headers need C++17: the build
# fails as shipped. This downloads the sdist from the package registry, sets the C++ standard
# to 17 in its two CMakeLists, builds a wheel and keeps it in
# ${HPCTK_WHEEL_CACHE:-~/.cache/hpc-toolkit/wheels}, keyed by torch and Python versions, so the
# next run (and CI on a machine that keeps the cache) installs it in seconds. About 10 minutes
# on 2 cores the first time.
set -euo pipefail

python=${PYTHON:-python3}
version=0.28.1
cache=${HPCTK_WHEEL_CACHE:-$HOME/.cache/hpc-toolkit/wheels}
key=$("$python" -c 'import sys, torch; v = torch.__version__.split("+")[0]; print(f"torch{v}-py{sys.version_info[0]}{sys.version_info[1]}")')
target="$cache/horovod-$version-$key"

if "$python" -c 'import horovod.torch' 2>/dev/null; then
    echo "build-horovod: horovod.torch already imports"
    exit 0
fi
if ! compgen -G "$target/horovod-*.whl" >/dev/null; then
    command -v cmake >/dev/null && command -v g++ >/dev/null || { echo "build-horovod: needs cmake and g++" >&2; exit 1; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "build-horovod: building Horovod $version for $key (about 10 minutes on 2 cores)"
    "$python" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: "horovod==$version" -d "$work"
    tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
    src="$work/horovod-$version"
    for cmakelists in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
        grep -q 'CMAKE_CXX_STANDARD 14' "$cmakelists" || { echo "build-horovod: $cmakelists has no C++14 line to patch" >&2; exit 1; }
        sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$cmakelists"
    done
    mkdir -p "$target.tmp"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j$(nproc)" "$python" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
        -w "$target.tmp" "$src" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
    rm -rf "$target" && mv "$target.tmp" "$target"  # only a finished wheel is ever cached
fi
"$python" -m pip install -q --disable-pip-version-check --no-deps "$target"/horovod-*.whl
"$python" -m pip install -q --disable-pip-version-check cloudpickle psutil pyyaml packaging
"$python" -c 'import horovod, horovod.torch as hvd; print(f"build-horovod: ok (horovod {horovod.__version__}, mpi {hvd.mpi_built()}, gloo {hvd.gloo_built()})")'
