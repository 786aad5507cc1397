#!/usr/bin/env bash
# Client SDKs and pdctl against real processes over the real protocol.
#
#   BUILD=build PDMESH_MODEL=models/...gguf PYTHON=build/venv/bin/python tests/integration/sdk.sh
#
# Part 1 (always): an unreachable router and one that never answers (a bound socket nobody
# serves) through the C SDK, pdmesh generate --router, pdctl and the Python package.
# Part 2 (when pdmesh-router and the model exist): a live mesh on free loopback ports -
# pdmesh-router, a prefill group of 2 ranks and a decode node - and
#   - C SDK blocking and streaming, pdmesh generate --router and the Python package equal the
#     single-process engine's greedy output (pdmesh generate --model --temp 0), through the
#     prefill group (local_threshold 0) and through the decode node's local prefill;
#   - 32 concurrent clients (threads, one shared libpdmesh client) all equal the engine;
#   - cancel mid-stream; kill -9 of a client in the middle of requests leaves the router
#     serving others and its requests end;
#   - every pdctl command with the right token; rejected without / with a wrong token.
# Every wait has a timeout; the mesh is stopped (by pid) on exit.
set -u
BUILD=${BUILD:-build}
bin=$BUILD/bin
model=${PDMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
py=${PYTHON:-python3}
export PYTHONPATH=$BUILD/python${PYTHONPATH:+:$PYTHONPATH}
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  sleep 0.5
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
. "$(dirname "$0")/../lib.sh"
free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "secret-admin-token-$$-$RANDOM" > "$tmp/token"
echo "wrong-token" > "$tmp/wrong"

# ---- part 1: no router / a router that never answers ----
dead=tcp://127.0.0.1:$(free_port)
expect "pdctl: token on the command line refused" 2 "$bin/pdctl" --token abc nodes
expect "pdctl: no token" 4 env -u PDMESH_ADMIN_TOKEN -u PDMESH_ADMIN_TOKEN_FILE "$bin/pdctl" --router "$dead" nodes
contains "pdctl: no token says how to give one" "$tmp/err" "--token-file"
expect "pdctl: usage error" 2 "$bin/pdctl" --token-file "$tmp/token" policy frob
expect "pdctl: unreachable router" 3 "$bin/pdctl" --router "$dead" --token-file "$tmp/token" --timeout 1000 nodes
contains "pdctl: unreachable named" "$tmp/err" "unreachable"
expect "pdctl --json: unreachable" 3 "$bin/pdctl" --router "$dead" --token-file "$tmp/token" --timeout 500 --json stats
contains "pdctl --json: error code" "$tmp/out" '"EUNREACHABLE"'
expect "generate --router: unreachable" 1 "$bin/pdmesh" generate --router "$dead" --prompt hi
contains "generate --router: unreachable named" "$tmp/err" "EUNREACHABLE"
expect "generate --router: local-only flag refused" 2 "$bin/pdmesh" generate --router "$dead" --prompt hi --threads 2

# A router that never answers: a ROUTER socket bound by a Python process that reads nothing.
"$py" -c '
import sys, time, zmq
s = zmq.Context().socket(zmq.ROUTER); p = s.bind_to_random_port("tcp://127.0.0.1")
print(p, flush=True); time.sleep(120)' > "$tmp/silent.port" &
pids+=($!)
for _ in $(seq 100); do [ -s "$tmp/silent.port" ] && break; sleep 0.1; done
silent=tcp://127.0.0.1:$(cat "$tmp/silent.port")
expect "C SDK: timeout against a silent router" 0 "$bin/pdm-sdk-itest" timeout "$silent" 800
expect "generate --router: timeout" 1 "$bin/pdmesh" generate --router "$silent" --prompt hi --timeout 700
contains "generate --router: timeout named" "$tmp/err" "ETIMEOUT"
expect "pdctl: silent router" 3 "$bin/pdctl" --router "$silent" --token-file "$tmp/token" --timeout 700 stats
contains "pdctl: silent router named" "$tmp/err" "did not answer"
if "$py" -c 'import pdmesh.pdmesh_pb2' 2>/dev/null; then
  expect "python: silent router and unreachable" 0 sh -c "'$py' tests/integration/sdk_python.py silent && '$py' tests/integration/sdk_python.py unreachable"
  expect "python: seed_for_choice equals the C function's" 0 "$py" tests/integration/sdk_python.py seeds
  expect "python: n=2 failed over per choice (scripted routers)" 0 timeout 120 "$py" tests/integration/sdk_python.py nfailover
else
  bad "python package importable" "build it with make python-sdk"
fi

# ---- part 2: a live mesh ----
if [ ! -x "$bin/pdmesh-router" ] || [ ! -f "$model" ]; then
  skip "live mesh tests (pdmesh-router or the model missing)"
  echo "sdk: $passed passed, $failed failed, $skipped skipped"
  [ "$failed" -eq 0 ]
  exit
fi
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$tmp/secret"
export PDMESH_SECRET_FILE=$tmp/secret
cport=$(free_port); nport=$(free_port); aport=$(free_port)
ep=tcp://127.0.0.1:$cport
admin=tcp://127.0.0.1:$aport
"$bin/pdmesh-router" --model "$model" --client "$ep" --node "tcp://127.0.0.1:$nport" \
  --admin "$admin" --http-port -1 --admin-token-file "$tmp/token" > "$tmp/router.log" 2>&1 &
pids+=($!)
"$bin/pdmesh-decode" --model "$model" --router "tcp://127.0.0.1:$nport" --node-id decode-0 \
  --threads 1 > "$tmp/decode.log" 2>&1 &
pids+=($!)
for r in 0 1; do
  "$bin/pdmesh-prefill" --model "$model" --router "tcp://127.0.0.1:$nport" --node-id "prefill-a/$r" \
    --group a --rank $r --group-size 2 --threads 1 > "$tmp/prefill$r.log" 2>&1 &
  pids+=($!)
done
ctl() { "$bin/pdctl" --router "$admin" --token-file "$tmp/token" --timeout 10000 "$@"; }
up=0
for _ in $(seq 120); do
  n=$(ctl --json nodes 2>/dev/null | "$py" -c 'import json,sys; print(sum(n["state"]=="alive" for n in json.load(sys.stdin)["nodes"]))' 2>/dev/null)
  [ "${n:-0}" -ge 3 ] && { up=1; break; }
  sleep 0.5
done
if [ $up -ne 1 ]; then
  bad "mesh up (router + 2 prefill ranks + decode node within 60 s)" "$(tail -5 "$tmp/router.log")"
  echo "sdk: $passed passed, $failed failed, $skipped skipped"
  exit 1
fi
ok "mesh up: 3 nodes alive"
expect "C SDK: ping round trips" 0 "$bin/pdm-sdk-itest" ping "$ep" 200 && cat "$tmp/out"

# The single-process engine's greedy outputs.
prompts=("The capital of France is" "Once upon a time" "def fibonacci(n):" "The three primary colors are")
n=16
: > "$tmp/local.jsonl"
for p in "${prompts[@]}"; do
  "$bin/pdmesh" generate --model "$model" --prompt "$p" --temp 0 -n $n --threads 1 --json >> "$tmp/local.jsonl" 2>/dev/null
done
"$py" - "$tmp/local.jsonl" "$tmp/expected.json" $n "${prompts[@]}" <<'EOF'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
n, prompts = int(sys.argv[3]), sys.argv[4:]
out = [dict(prompt=p, n=n, **{k: json.loads(l)[k] for k in ("tokens", "text")}) for p, l in zip(prompts, lines)]
json.dump(out, open(sys.argv[2], "w"))
EOF
expected_text() { "$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))[int(sys.argv[2])]["text"])' "$tmp/expected.json" "$1"; }

# Through the prefill group first (every prompt disaggregated), then through local prefill.
for mode in group local; do
  if [ $mode = group ]; then thr=0; else thr=32; fi
  expect "pdctl policy set local_threshold $thr" 0 ctl policy set local_threshold $thr
  for i in 0 1; do
    want=$(expected_text $i)
    expect "[$mode] C SDK blocking ($i)" 0 timeout 300 "$bin/pdm-sdk-itest" generate "$ep" $n "${prompts[$i]}" &&
      { [ "$(cat "$tmp/out")" = "$want" ] && ok "[$mode] C SDK blocking equals the engine ($i)" ||
        bad "[$mode] C SDK blocking equals the engine ($i)" "got '$(cat "$tmp/out")' want '$want'"; }
    expect "[$mode] C SDK streaming ($i)" 0 timeout 300 "$bin/pdm-sdk-itest" stream "$ep" $n "${prompts[$i]}" &&
      { [ "$(cat "$tmp/out")" = "$want" ] && ok "[$mode] C SDK streaming equals the engine ($i)" ||
        bad "[$mode] C SDK streaming equals the engine ($i)" "got '$(cat "$tmp/out")' want '$want'"; }
    expect "[$mode] pdmesh generate --router ($i)" 0 timeout 300 "$bin/pdmesh" generate --router "$ep" --temp 0 -n $n --prompt "${prompts[$i]}" --stats &&
      { [ "$(cat "$tmp/out")" = "$want" ] && ok "[$mode] pdmesh generate --router equals --model ($i)" ||
        bad "[$mode] pdmesh generate --router equals --model ($i)" "got '$(cat "$tmp/out")' want '$want'"; }
  done
  contains "[$mode] generate --stats prints TTFT" "$tmp/err" "TTFT:"
  contains "[$mode] generate --stats prints tokens/s" "$tmp/err" "tokens/s"
  [ $mode = group ] && contains "[group] served by the prefill group" "$tmp/err" " on a,"
  chat_want=$("$bin/pdmesh" generate --model "$model" --chat --temp 0 -n $n --threads 1 --prompt "What is 2+2?" 2>/dev/null)
  expect "[$mode] pdmesh generate --router --chat" 0 timeout 300 "$bin/pdmesh" generate --router "$ep" --chat --temp 0 -n $n --prompt "What is 2+2?" &&
    { [ "$(cat "$tmp/out")" = "$chat_want" ] && ok "[$mode] chat through the router equals the engine" ||
      bad "[$mode] chat through the router equals the engine" "got '$(cat "$tmp/out")' want '$chat_want'"; }
done

# A mesh described by a pdmesh-up configuration (router endpoints, run_dir with pids and
# admin-token): pdmesh generate --config and pdctl --config find it there.
mkdir -p "$tmp/run"
touch "$tmp/run/pids"
cp "$tmp/token" "$tmp/run/admin-token"
printf 'model: %s\nrun_dir: %s\nrouter:\n  client: %s\n  admin: %s\n' "$model" "$tmp/run" "$ep" "$admin" > "$tmp/mesh.yaml"
want=$(expected_text 1)
expect "pdmesh generate --config (mesh from pdmesh up)" 0 timeout 300 "$bin/pdmesh" generate --config "$tmp/mesh.yaml" --temp 0 -n $n --prompt "${prompts[1]}" &&
  { [ "$(cat "$tmp/out")" = "$want" ] && ok "generate --config equals the engine" || bad "generate --config equals the engine" "$(cat "$tmp/out")"; }
expect "pdctl --config (endpoint and run_dir/admin-token)" 0 env -u PDMESH_ADMIN_TOKEN -u PDMESH_ADMIN_TOKEN_FILE "$bin/pdctl" --config "$tmp/mesh.yaml" nodes
rm "$tmp/run/pids"
expect "generate --config without a running mesh" 1 "$bin/pdmesh" generate --config "$tmp/mesh.yaml" --prompt hi
contains "generate --config says to run pdmesh up" "$tmp/err" "pdmesh up"

# 32 concurrent clients (threads sharing one client), half streaming.
expect "C SDK: 32 concurrent clients equal the engine" 0 timeout 600 "$bin/pdm-sdk-itest" concurrent "$ep" 32 "$tmp/expected.json"
cat "$tmp/out" "$tmp/err" | head -5
# ... and again with every prompt prefilled by the prefill group (disaggregated).
ctl policy set local_threshold 0 > /dev/null
expect "C SDK: 32 concurrent clients through the prefill group equal the engine" 0 timeout 600 "$bin/pdm-sdk-itest" concurrent "$ep" 32 "$tmp/expected.json"
cat "$tmp/out" "$tmp/err" | head -5
ctl policy set local_threshold 32 > /dev/null

expect "C SDK: cancel mid-stream" 0 timeout 300 "$bin/pdm-sdk-itest" cancel "$ep" "Once upon a time"
expect "python: sync, iterator, cancel, typed errors" 0 timeout 600 "$py" tests/integration/sdk_python.py live "$ep" "$tmp/expected.json"
grep -q FAIL "$tmp/out" && cat "$tmp/out"
# OpenAI's sampling adjustments and log-probabilities through both SDKs, against the engine
# with the same flags, through the prefill group (it samples the first token).
ctl policy set local_threshold 0 > /dev/null
sp="The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Then"
"$bin/pdmesh" generate --model "$model" --prompt "$sp" --temp 0 -n $n --threads 1 --json \
  --logprobs 3 --presence-penalty 0.5 --frequency-penalty 0.5 --logit-bias 13=-100 > "$tmp/sampling.ref" 2>/dev/null
expect "C SDK: penalties, logit_bias, logprobs, seed" 0 timeout 300 "$bin/pdm-sdk-itest" sampling "$ep" $n 3 "$sp" "$tmp/sampling.ref"
expect "python: penalties, logit_bias, logprobs, seed" 0 timeout 300 "$py" tests/integration/sdk_python.py sampling "$ep" "$sp" $n 3 "$tmp/sampling.ref"
grep -q FAIL "$tmp/out" && cat "$tmp/out"
# Structured output (json_schema / json_object) through both SDKs and the prefill group.
expect "C SDK: json_schema, json_object, a refused keyword" 0 timeout 300 "$bin/pdm-sdk-itest" structured "$ep" 120
expect "python: json_schema, json_object, a refused keyword" 0 timeout 300 "$py" tests/integration/sdk_python.py structured "$ep" 120
grep -q FAIL "$tmp/out" && cat "$tmp/out"
# OpenAI's n (the choices share the prompt: one prefill through the group) and tools.
expect "C SDK: n=3 choices, streamed per choice, greedy choices equal, n=9 refused" 0 timeout 300 "$bin/pdm-sdk-itest" nchoices "$ep" 16 "$sp"
expect "python: n=3 choices, streamed per choice, greedy choices equal, n=9 refused" 0 timeout 300 "$py" tests/integration/sdk_python.py nchoices "$ep" "$sp" 16
grep -q FAIL "$tmp/out" && cat "$tmp/out"
expect "C SDK: tools (required, named, the next turn)" 0 timeout 300 "$bin/pdm-sdk-itest" tools "$ep" 60
expect "python: tools (required, named, the next turn, with n=2)" 0 timeout 300 "$py" tests/integration/sdk_python.py tools "$ep" 60
grep -q FAIL "$tmp/out" && cat "$tmp/out"
ctl policy set local_threshold 32 > /dev/null

# Beam search (local prefill at this threshold): C SDK (pdmesh generate --router) and Python
# equal the single-process disaggregated run (pdmesh disagg-run --beams, one prefill rank).
bp=${prompts[0]}
"$bin/pdmesh" disagg-run --model "$model" --prefill-ranks 1 --method single --threads 1 --beams 4 --n-best 2 -n $n --prompt "$bp" --json > "$tmp/beam.ref" 2>/dev/null
expect "C SDK: beam search (pdmesh generate --router --beams 4 --n-best 2)" 0 timeout 300 "$bin/pdmesh" generate --router "$ep" --beams 4 --n-best 2 -n $n --prompt "$bp" --json &&
  { "$py" -c 'import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2]))["n_best"]; sys.exit(0 if [x["tokens"] for x in a["beams"]]==[x["tokens"] for x in b] and a["text"]==b[0]["text"] else 1)' "$tmp/out" "$tmp/beam.ref" &&
    ok "C SDK: the n best equal disagg-run --beams 4, the text is the best beam's" ||
    bad "C SDK: the n best equal disagg-run --beams 4" "$(head -c 400 "$tmp/out")"; }
expect "python: beams, ignore_eos" 0 timeout 600 "$py" tests/integration/sdk_python.py beams "$ep" "$bp" $n "$tmp/beam.ref"
grep -q FAIL "$tmp/out" && cat "$tmp/out"

# pdctl: every command with the right token; rejected without / with a wrong one.
expect "pdctl nodes" 0 ctl nodes && contains "pdctl nodes lists decode-0" "$tmp/out" "decode-0"
expect "pdctl nodes --json" 0 ctl --json nodes &&
  { "$py" -c 'import json,sys; n={x["node_id"]:x for x in json.load(open(sys.argv[1]))["nodes"]}; assert n["prefill-a/1"]["role"]=="prefill" and n["decode-0"]["capacity"]["kv_tokens"]>0' "$tmp/out" &&
    ok "pdctl nodes --json parses, names every node" || bad "pdctl nodes --json parses, names every node" "$(head -c 300 "$tmp/out")"; }
expect "pdctl node" 0 ctl node decode-0 && contains "pdctl node shows capacity" "$tmp/out" "capacity:"
expect "pdctl node unknown" 1 ctl node no-such-node
expect "pdctl drain" 0 ctl drain decode-0
expect "pdctl node shows draining" 0 ctl --json node decode-0 && contains "pdctl drained state" "$tmp/out" '"draining"'
expect "pdctl undrain" 0 ctl undrain decode-0
expect "pdctl stats" 0 ctl stats
expect "pdctl stats --json" 0 ctl --json stats && contains "pdctl stats --json values" "$tmp/out" '"values"'
expect "pdctl policy get" 0 ctl policy get && contains "pdctl policy get lists local_threshold" "$tmp/out" "local_threshold"
expect "pdctl policy get KEY" 0 ctl policy get max_attempts
expect "pdctl policy set" 0 ctl policy set max_attempts 3
expect "pdctl policy set bad key" 1 ctl policy set no_such_key 1
expect "pdctl lut show" 0 ctl lut show
cp docs/perf/partition-table-r2.json "$tmp/lut.json"
expect "pdctl lut load" 0 ctl lut load "$tmp/lut.json"
expect "pdctl lut show after load" 0 ctl --json lut show && contains "pdctl lut show returns the table" "$tmp/out" '"table"'
echo 'not json' > "$tmp/bad.json"
expect "pdctl lut load refuses non-JSON" 1 ctl lut load "$tmp/bad.json"
expect "pdctl requests" 0 ctl requests
expect "pdctl cancel unknown id" 1 ctl cancel 987654
expect "pdctl wrong token" 4 "$bin/pdctl" --router "$admin" --token-file "$tmp/wrong" nodes
contains "pdctl wrong token named" "$tmp/err" "pdctl: nodes:"
expect "pdctl no token" 4 env -u PDMESH_ADMIN_TOKEN -u PDMESH_ADMIN_TOKEN_FILE "$bin/pdctl" --router "$admin" stats
expect "pdctl token from \$PDMESH_ADMIN_TOKEN" 0 env PDMESH_ADMIN_TOKEN="$(cat "$tmp/token")" "$bin/pdctl" --router "$admin" stats

# pdctl cancel of a live request, found with pdctl requests.
"$bin/pdm-sdk-itest" hold "$ep" 1 "Once upon a time" > /dev/null 2>&1 &
holder=$!
pids+=($holder)
rid=
for _ in $(seq 100); do
  rid=$(ctl --json requests 2>/dev/null | "$py" -c 'import json,sys; r=json.load(sys.stdin)["requests"]; print(r[0]["router_request_id"] if r else "")' 2>/dev/null)
  [ -n "$rid" ] && break
  sleep 0.1
done
if [ -n "$rid" ]; then
  expect "pdctl cancel ID" 0 ctl cancel "$rid"
else
  bad "pdctl requests shows a running request"
fi

# kill -9 of a client in the middle of requests: others are still served, its requests end.
"$bin/pdm-sdk-itest" hold "$ep" 4 "Once upon a time" > /dev/null 2>&1 &
victim=$!
pids+=($victim)
kill -9 "$holder" 2>/dev/null
wait "$holder" 2>/dev/null
for _ in $(seq 100); do
  k=$(ctl --json requests 2>/dev/null | "$py" -c 'import json,sys; print(len(json.load(sys.stdin)["requests"]))' 2>/dev/null)
  [ "${k:-0}" -ge 4 ] && break
  sleep 0.1
done
{ kill -9 "$victim"; wait "$victim"; } 2>/dev/null
wait "$victim" 2>/dev/null
want=$(expected_text 0)
expect "after kill -9 of a client: another client is served" 0 timeout 300 "$bin/pdm-sdk-itest" generate "$ep" $n "${prompts[0]}" &&
  { [ "$(cat "$tmp/out")" = "$want" ] && ok "after kill -9: output still equals the engine" || bad "after kill -9: output still equals the engine"; }
left=99
for _ in $(seq 120); do
  left=$(ctl --json requests 2>/dev/null | "$py" -c 'import json,sys; print(len(json.load(sys.stdin)["requests"]))' 2>/dev/null)
  [ "${left:-99}" = 0 ] && break
  sleep 0.5
done
[ "${left:-99}" = 0 ] && ok "the killed client's requests ended (none open)" || bad "the killed client's requests ended" "$left still open"
kill -0 "${pids[1]}" 2>/dev/null && ok "router still running" || bad "router still running"

echo "sdk: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
