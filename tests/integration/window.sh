#!/usr/bin/env bash
# Windowed local layers through the router (decode_node/decode.h "Windowed layers"):
# pdmesh-router + a prefill group of 2 ranks + a decode node on a random gemma3 model whose
# local layers have a 16-token window (30 rows per head at --kv-window 2), driven by
# pdm-rclient over ZeroMQ.
#
#   BIN=build/bin tests/integration/window.sh
#
# - A prompt well past the window, streamed by the group (the local layers' rows land in
#   staging, the last 15 are kept), 60 new tokens: the text equals pdmesh generate --temp 0
#   (single process, full KV + mask). A short one prefilled on the decode node: the same.
# - The decode node's --kv-budget is below the request's prompt + new tokens (its
#   full KV) but above its windowed footprint and staging: the router, counting the layout the
#   node announced, dispatches it (counting full KV it would wait until the deadline).
# - With --kv-window 0 on the node, the same request is refused for lack of KV (the router
#   holds it until its deadline).
# Every wait is bounded; every process started here is stopped by its pid on exit.
set -u
BIN=${BIN:-build/bin}
RUN=$(mktemp -d /tmp/pdm-win.XXXXXX)
P=$((20000 + RANDOM % 20000))
CLIENT=tcp://127.0.0.1:$P NODE=tcp://127.0.0.1:$((P + 1)) ADMIN=tcp://127.0.0.1:$((P + 2))
pass=0 fail=0
ok() { echo "ok   - $1"; pass=$((pass + 1)); }
bad() { echo "FAIL - $1"; fail=$((fail + 1)); }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  sleep 0.5
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
  if [ "$fail" -gt 0 ]; then
    for f in "$RUN"/*.log; do echo "---- $f"; tail -n 15 "$f"; done
  fi
  [ -n "${KEEP:-}" ] && cp -r "$RUN" "$KEEP"
  rm -rf "$RUN"
}
trap cleanup EXIT

MODEL=$RUN/gemma3.gguf
"$BIN/pdmesh" make-test-model --arch gemma3 --wtype f32 --emb-type f32 --out "$MODEL" > /dev/null ||
  { echo "window: cannot write the test model"; exit 1; }
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$RUN/secret"
head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$RUN/token"
chmod 600 "$RUN/secret" "$RUN/token"
export PDMESH_SECRET_FILE="$RUN/secret" PDMESH_LOG=info
TOKEN=$(cat "$RUN/token")
PY=python3
jq_() { $PY -c "import json,sys; d=[json.loads(l) for l in sys.stdin if l.strip()]; print($1)"; }
admin() { PDMESH_ADMIN_TOKEN=$TOKEN "$BIN/pdm-rclient" admin --ep "$ADMIN" --timeout 10 "$@"; }
wait_nodes() { # count of alive nodes, seconds
  local end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ]; do
    n=$(admin --op nodes 2>/dev/null | jq_ 'sum(1 for x in d[0]["nodes"] if x["state"]=="alive")' 2>/dev/null)
    [ "${n:-0}" -ge "$1" ] && return 0
    sleep 0.3
  done
  return 1
}
gen() { "$BIN/pdm-rclient" gen --ep "$CLIENT" --timeout 120 "$@"; }
ref() { "$BIN/pdmesh" generate --model "$MODEL" --temp 0 --kv-dtype f32 "$@" 2>/dev/null; }

"$BIN/pdmesh-router" --model "$MODEL" --client "$CLIENT" --node "$NODE" --admin "$ADMIN" \
  --http-port -1 --admin-token-file "$RUN/token" --method kvr-e --local-threshold 24 \
  --max-tokens 512 > "$RUN/router.log" 2>&1 &
pids+=("$!")
for r in 0 1; do
  "$BIN/pdmesh-prefill" --model "$MODEL" --router "$NODE" --node-id "pa/$r" --group pa \
    --rank "$r" --group-size 2 --timeout 5 --kv-dtype f32 > "$RUN/p$r.log" 2>&1 &
  pids+=("$!")
done
LONG="The sea was calm that morning and the boats went out early, one after another, past the harbour wall and the old lighthouse"
NEW=60
n_prompt=$("$BIN/pdmesh" generate --model "$MODEL" --temp 0 -n 1 --json --prompt "$LONG" 2>/dev/null | jq_ 'd[0]["prompt_tokens"]')
# The windowed footprint (decode.h, pdm_kvwin_plan) of the gemma3 preset: 7 layers, 6 local
# with 30 rows per head, plus the staging of the streamed prompt; the budget just holds it.
BUDGET=$($PY -c "import math; n=$n_prompt; a=n+$NEW; print(math.ceil((a+6*30)/7)+math.ceil(6*n/7)+2)")
start_decode() { # name, --kv-window
  "$BIN/pdmesh-decode" --model "$MODEL" --router "$NODE" --node-id "$1" --kv-dtype f32 \
    --kv-budget "$BUDGET" --kv-window "$2" > "$RUN/$1.log" 2>&1 &
  DEC=$!; pids+=("$DEC")
}
start_decode dw 2
check "router, 2 prefill ranks and a windowed decode node register" "wait_nodes 3 60"

gen --prompt "$LONG" -n $NEW --ignore-eos > "$RUN/long.json"
ref --prompt "$LONG" -n $NEW --ignore-eos > "$RUN/long.ref"
check "a ${n_prompt}-token prompt (group, kvr-e) + $NEW tokens past the 16-token window, on $BUDGET KV slots (< $((n_prompt + NEW)), its full KV): equals pdmesh generate --temp 0" \
  "[ \"\$(jq_ 'd[0][\"ok\"] and d[0][\"usage\"][\"prefill_method\"]==\"kvr-e\"' < $RUN/long.json)\" = True ] && [ \"\$(jq_ 'd[0][\"text\"]' < $RUN/long.json)\" = \"\$(cat $RUN/long.ref)\" ] && [ \$(( n_prompt + NEW )) -gt $BUDGET ]"
gen --prompt "Hi there" -n 60 --ignore-eos > "$RUN/short.json"
ref --prompt "Hi there" -n 60 --ignore-eos > "$RUN/short.ref"
check "a short prompt (local prefill on the decode node) + 60 tokens: equals pdmesh generate --temp 0" \
  "[ \"\$(jq_ 'd[0][\"usage\"][\"prefill_method\"]' < $RUN/short.json)\" = local ] && [ \"\$(jq_ 'd[0][\"text\"]' < $RUN/short.json)\" = \"\$(cat $RUN/short.ref)\" ]"

kill -TERM "$DEC"
start_decode dfull 0
sleep 1
check "a decode node with --kv-window 0 registers" "wait_nodes 3 30"
gen --prompt "$LONG" -n $NEW --ignore-eos --deadline-ms 3000 > "$RUN/full.json"
check "with full KV the same request does not fit $BUDGET slots: not served (deadline)" \
  "[ \"\$(jq_ 'd[0][\"ok\"]' < $RUN/full.json)\" = False ]"

echo "window: $pass passed, $fail failed"
[ "$fail" = 0 ]
