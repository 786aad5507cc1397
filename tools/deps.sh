#!/usr/bin/env bash
# Installs what pdmesh needs to build and test, skipping what is already present.
#   tools/deps.sh VENV_DIR [--golden|--bench]
# Debian packages through apt-get (as root, or with sudo when available); Python tools into
# a virtual environment at VENV_DIR. The container tools (buildah, podman, runc, debootstrap,
# CNI plugins) serve make image and make container-test. --golden also installs
# llama-cpp-python (builds llama.cpp from source, several minutes), needed only to regenerate
# tests/golden/golden.json.
# --bench is --golden plus gnuplot for the engine benchmark's plot.
set -euo pipefail

venv=${1:?usage: tools/deps.sh VENV_DIR [--golden]}
golden=${2:-}

packages=(
  build-essential pkg-config clang libclang-rt-14-dev
  check libpcre2-dev libcjson-dev libxxhash-dev
  libucx-dev ucx-utils libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
  libuv1-dev libhttp-parser-dev libssl-dev libyaml-dev
  python3 python3-venv python3-pip
  curl prometheus
  iproute2 nftables
  buildah podman runc debootstrap containernetworking-plugins
)
if [ "$golden" = "--bench" ]; then packages+=(gnuplot-nox); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "deps: Debian packages present"
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "deps: creating Python venv in $venv"
  python3 -m venv "$venv"
fi
# pyzmq + grpcio-tools: the Python SDK (sdk/python) and its protobuf module, generated at build
# time by grpc_tools' protoc (it ships a protoc matching its protobuf runtime; Debian 12 has no
# protobuf-compiler/python3-protobuf pair newer than 3.21).
# kubernetes-validate: offline schema checks of deploy/k8s (tests/deploy/check_k8s.py).
want_py=(numpy gguf pyzmq grpcio-tools openai kubernetes-validate)
if [ "$golden" = "--golden" ] || [ "$golden" = "--bench" ]; then
  want_py+=(llama-cpp-python jinja2)
fi
need_py=()
for m in "${want_py[@]}"; do
  mod=${m//-/_}
  [ "$mod" = "llama_cpp_python" ] && mod=llama_cpp
  [ "$mod" = "pyzmq" ] && mod=zmq
  [ "$mod" = "grpcio_tools" ] && mod=grpc_tools
  if ! "$venv/bin/python" -c "import $mod" 2>/dev/null; then need_py+=("$m"); fi
done
if [ ${#need_py[@]} -gt 0 ]; then
  echo "deps: pip installing ${need_py[*]}"
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$venv/bin/pip" install -q "${need_py[@]}"
else
  echo "deps: Python tools present"
fi
