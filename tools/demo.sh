#!/usr/bin/env bash
# make demo: start a whole local mesh (router, a prefill group of 2 ranks, a decode node) from
# deploy/local/default.yaml, ask it a chat question through the client SDK (the answer streams
# as it is generated; TTFT and tokens/s follow on stderr), and stop the mesh again.
#   BUILD=build CONFIG=deploy/local/default.yaml PROMPT="..." tools/demo.sh
set -euo pipefail
build=${BUILD:-build}
conf=${CONFIG:-deploy/local/default.yaml}
prompt=${PROMPT:-"Explain in two sentences why the sky is blue."}
pdmesh=$build/bin/pdmesh

"$pdmesh" up --config "$conf"
trap '"$pdmesh" down --config "$conf" || true' EXIT
echo "pdmesh demo: $prompt" >&2
"$pdmesh" generate --config "$conf" --chat --stats -n 96 --prompt "$prompt"
echo >&2
