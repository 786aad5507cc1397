#!/usr/bin/env bash
# Router overhead: a router with one decode node that answers at once (pdm-rclient fakenode);
# sequential requests through the client socket; prints p50/p99 of the client's round trip
# (client -> router -> node, two control-plane round trips, -> client), as JSON lines.
#   BIN=build/bin PDMESH_MODEL=models/....gguf tests/integration/overhead.sh [COUNT]
set -u
BIN=${BIN:-build/bin}
MODEL=${PDMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
COUNT=${1:-2000}
RUN=$(mktemp -d /tmp/pdm-ovh.XXXXXX)
P=$((20000 + RANDOM % 20000))
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$RUN/secret"
export PDMESH_SECRET_FILE="$RUN/secret"
"$BIN/pdmesh-router" --model "$MODEL" --client tcp://127.0.0.1:$P --node tcp://127.0.0.1:$((P + 1)) \
  --admin tcp://127.0.0.1:$((P + 2)) --http-port -1 > "$RUN/router.log" 2>&1 &
rp=$!
sleep 1
"$BIN/pdm-rclient" fakenode --ep tcp://127.0.0.1:$((P + 1)) --node-id fake0 --timeout 120 > "$RUN/fake.log" &
fp=$!
for _ in $(seq 1 50); do grep -q registered "$RUN/fake.log" && break; sleep 0.1; done
rc=0
for n in 1 16; do "$BIN/pdm-rclient" bench --ep tcp://127.0.0.1:$P --count "$COUNT" -n $n || rc=1; done
kill "$rp" "$fp" 2>/dev/null
wait 2>/dev/null
rm -rf "$RUN"
exit $rc
