#!/usr/bin/env bash
# CURVE on every router socket with a ZAP allowlist, against real processes (docs/router.md,
# "CURVE"):
#   BUILD=build PDMESH_MODEL=models/...gguf PYTHON=build/venv/bin/python tests/integration/curve.sh
#
#   - pdmesh keygen writes PREFIX.key (0600) and PREFIX.pub;
#   - a router whose secret file is group/other-readable (0644) refuses to start;
#   - a router with --curve-secret-file/--curve-allow: a decode node (flags) and a prefill rank
#     (environment) register over CURVE; an allowed client (pdmesh generate, the Python
#     package) gets the engine's greedy output; pdctl with an allowed key is answered;
#   - a client whose key is not in the allowlist, and a plain (non-CURVE) client, get no
#     service and are told so at once: generate fails with EUNAUTHORIZED, the Python package
#     raises UnauthorizedError, pdctl exits 4 (the socket monitor sees the failed handshake);
#     the router logs the refusals; the allowed client is still served afterwards;
#   - pdmesh up with `curve: true`: keys and allowlist in run_dir/curve, the nodes register,
#     pdmesh generate --config and pdctl --config pick the client key up, a plain client fails.
# Every wait has a timeout; the processes are stopped (by pid) on exit.
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
done_() { echo "curve: $passed passed, $failed failed"; [ "$failed" -eq 0 ]; exit; }

if [ ! -x "$bin/pdmesh-router" ] || [ ! -f "$model" ]; then
  echo "curve: pdmesh-router or the model missing"; exit 1
fi

# ---- keys ----
for k in server client stranger node; do
  expect "keygen $k" 0 "$bin/pdmesh" keygen --out "$tmp/$k"
done
[ "$(stat -c %a "$tmp/server.key")" = 600 ] && ok "keygen: PREFIX.key is 0600" || bad "keygen: PREFIX.key is 0600" "$(stat -c %a "$tmp/server.key")"
[ "$(head -1 "$tmp/server.key")" = "$(cat "$tmp/server.pub")" ] && [ "$(wc -l < "$tmp/server.key")" -eq 2 ] &&
  ok "keygen: PREFIX.pub is line 1 of PREFIX.key" || bad "keygen: PREFIX.pub is line 1 of PREFIX.key"
expect "keygen refuses to overwrite a key" 1 "$bin/pdmesh" keygen --out "$tmp/server"
{ echo "# clients allowed on this router"; echo "$(cat "$tmp/client.pub")   # the test client"; echo; cat "$tmp/node.pub"; } > "$tmp/allow"

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$tmp/secret"
echo "curve-admin-token-$$-$RANDOM" > "$tmp/token"
export PDMESH_SECRET_FILE=$tmp/secret
cport=$(free_port); nport=$(free_port); aport=$(free_port)
ep=tcp://127.0.0.1:$cport
admin=tcp://127.0.0.1:$aport
router_args=(--model "$model" --client "$ep" --node "tcp://127.0.0.1:$nport" --admin "$admin"
             --http-port -1 --admin-token-file "$tmp/token" --curve-allow "$tmp/allow")

# ---- a readable secret file is refused ----
cp "$tmp/server.key" "$tmp/open.key"; chmod 644 "$tmp/open.key"
expect "router refuses a 0644 secret file" 1 timeout 60 "$bin/pdmesh-router" "${router_args[@]}" --curve-secret-file "$tmp/open.key"
contains "refusal names the mode" "$tmp/err" "mode 644"
expect "router refuses CURVE without an allowlist" 1 timeout 60 "$bin/pdmesh-router" --model "$model" \
  --client "$ep" --node "tcp://127.0.0.1:$nport" --admin "$admin" --http-port -1 --curve-secret-file "$tmp/server.key"

# ---- a CURVE mesh: router, decode node (flags), prefill rank (environment) ----
PDMESH_LOG=info "$bin/pdmesh-router" "${router_args[@]}" --curve-secret-file "$tmp/server.key" > "$tmp/router.log" 2>&1 &
pids+=($!)
"$bin/pdmesh-decode" --model "$model" --router "tcp://127.0.0.1:$nport" --node-id decode-0 --threads 1 \
  --curve-server-key "$tmp/server.pub" --curve-key "$tmp/node.key" > "$tmp/decode.log" 2>&1 &
pids+=($!)
PDMESH_CURVE_SERVER_KEY_FILE=$tmp/server.pub PDMESH_CURVE_KEY_FILE=$tmp/node.key \
  "$bin/pdmesh-prefill" --model "$model" --router "tcp://127.0.0.1:$nport" --node-id prefill-a/0 \
  --group a --rank 0 --group-size 1 --threads 1 > "$tmp/prefill.log" 2>&1 &
pids+=($!)
# a node with a key not in the allowlist never registers
"$bin/pdmesh-decode" --model "$model" --router "tcp://127.0.0.1:$nport" --node-id intruder --threads 1 \
  --curve-server-key "$tmp/server.pub" --curve-key "$tmp/stranger.key" > "$tmp/intruder.log" 2>&1 &
pids+=($!)
ctl() { "$bin/pdctl" --router "$admin" --token-file "$tmp/token" --curve-server-key "$tmp/server.pub" --curve-key "$tmp/client.key" "$@"; }
up=0
for _ in $(seq 120); do
  kill -0 "${pids[0]}" 2>/dev/null || { bad "router running" "$(tail -3 "$tmp/router.log")"; done_; }
  n=$(ctl --timeout 5000 --json nodes 2>/dev/null | "$py" -c 'import json,sys; print(sum(n["state"]=="alive" for n in json.load(sys.stdin)["nodes"]))' 2>/dev/null)
  [ "${n:-0}" -ge 2 ] && { up=1; break; }
  sleep 0.5
done
if [ $up -ne 1 ]; then
  bad "nodes register over CURVE (decode + prefill within 60 s)" "$(tail -5 "$tmp/router.log")"
  done_
fi
ok "nodes register over CURVE; pdctl with an allowed key is answered"
expect "pdctl nodes over CURVE" 0 ctl --timeout 5000 nodes
if grep -q intruder "$tmp/out"; then bad "a node with a key not allowed is not registered" "$(cat "$tmp/out")"; else ok "a node with a key not allowed is not registered"; fi

# ---- allowed client: output equal to the engine (through the prefill group and locally) ----
prompt="The capital of France is"
want=$("$bin/pdmesh" generate --model "$model" --prompt "$prompt" --temp 0 -n 12 --threads 1 2>/dev/null)
[ -n "$want" ] && ok "the engine's reference output is not empty" || bad "the engine's reference output is not empty"
cgen=("$bin/pdmesh" generate --router "$ep" --temp 0 -n 12 --prompt "$prompt")
allowed=(--curve-server-key "$tmp/server.pub" --curve-key "$tmp/client.key")
for thr in 0 32; do
  expect "policy local_threshold $thr" 0 ctl --timeout 5000 policy set local_threshold $thr
  expect "allowed client generates (local_threshold $thr)" 0 timeout 300 "${cgen[@]}" "${allowed[@]}" --timeout 120000 &&
    { [ "$(cat "$tmp/out")" = "$want" ] && ok "allowed client output equals the engine (local_threshold $thr)" ||
      bad "allowed client output equals the engine (local_threshold $thr)" "got '$(cat "$tmp/out")' want '$want'"; }
done

# ---- refused clients: told so at once (the handshake failure, seen by the socket monitor),
# long before their 30 s timeouts ----
t0=$(date +%s.%N)
expect "client with a key not in the allowlist fails" 1 timeout 60 "${cgen[@]}" --curve-server-key "$tmp/server.pub" --curve-key "$tmp/stranger.key" --timeout 30000
grep -q "EUNAUTHORIZED" "$tmp/err" && grep -q "allowlist" "$tmp/err" && ok "  ... with EUNAUTHORIZED naming the allowlist" || bad "  ... with EUNAUTHORIZED naming the allowlist" "$(cat "$tmp/err")"
expect "plain (non-CURVE) client fails" 1 timeout 60 env -u PDMESH_CURVE_SERVER_KEY_FILE -u PDMESH_CURVE_KEY_FILE "$bin/pdmesh" generate --router "$ep" --prompt hi -n 4 --timeout 30000
grep -q "EUNAUTHORIZED" "$tmp/err" && grep -q "CURVE" "$tmp/err" && ok "  ... with EUNAUTHORIZED naming CURVE" || bad "  ... with EUNAUTHORIZED naming CURVE" "$(cat "$tmp/err")"
t1=$(date +%s.%N)
"$py" -c "import sys; sys.exit(0 if $t1 - $t0 < 10 else 1)" && ok "refused calls end at once, not at their timeouts" || bad "refused calls end at once, not at their timeouts" "$t0 -> $t1"
expect "plain pdctl is refused (exit 4, unauthorized)" 4 env -u PDMESH_CURVE_SERVER_KEY_FILE -u PDMESH_CURVE_KEY_FILE "$bin/pdctl" --router "$admin" --token-file "$tmp/token" --timeout 30000 nodes
expect "pdctl with a key not allowed is refused (exit 4)" 4 "$bin/pdctl" --router "$admin" --token-file "$tmp/token" --curve-server-key "$tmp/server.pub" --curve-key "$tmp/stranger.key" --timeout 30000 nodes
chmod 644 "$tmp/client.key"
expect "client refuses its own 0644 key file" 1 "${cgen[@]}" "${allowed[@]}" --timeout 2000
contains "  ... naming the mode" "$tmp/err" "chmod 600"
chmod 600 "$tmp/client.key"
contains "router logs the refusals" "$tmp/router.log" "CURVE: refused"

# ---- the allowed client keeps being served; the Python package over CURVE ----
expect "allowed client still served after the refusals" 0 timeout 300 "${cgen[@]}" "${allowed[@]}" --timeout 120000 &&
  { [ "$(cat "$tmp/out")" = "$want" ] && ok "  ... with the engine's output" || bad "  ... with the engine's output" "$(cat "$tmp/out")"; }
if "$py" -c 'import pdmesh.pdmesh_pb2' 2>/dev/null; then
  expect "python: allowed key served, other key and plain refused" 0 timeout 300 "$py" - "$ep" "$tmp" "$prompt" "$want" <<'PYEOF'
import sys, pdmesh
from pdmesh import errors
ep, d, prompt, want = sys.argv[1:5]
with pdmesh.Client(ep, timeout=120, curve_server_key_file=d + "/server.pub",
                   curve_key_file=d + "/client.key") as c:
    r = c.generate(prompt, max_tokens=12, temperature=0)
    assert r.text == want, (r.text, want)
for kw in (dict(curve_server_key_file=d + "/server.pub", curve_key_file=d + "/stranger.key"), {}):
    with pdmesh.Client(ep, timeout=30, connect_timeout=30, **kw) as c:
        try:
            c.generate(prompt, max_tokens=4, temperature=0)
            sys.exit("a refused client was served: %r" % kw)
        except errors.UnauthorizedError:
            pass
print("ok")
PYEOF
else
  bad "python package importable" "build it with make python-sdk"
fi

# ---- the CURVE router stops cleanly on SIGTERM (the ZAP thread is joined) ----
kill "${pids[0]}"
stopped=0
for _ in $(seq 100); do kill -0 "${pids[0]}" 2>/dev/null || { stopped=1; break; }; sleep 0.1; done
wait "${pids[0]}"; rs=$?
[ $stopped = 1 ] && [ $rs = 0 ] && ok "CURVE router exits 0 on SIGTERM within 10 s" || bad "CURVE router exits 0 on SIGTERM within 10 s" "stopped=$stopped status=$rs"

# ---- pdmesh up with curve: true ----
for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
# In sanitizer builds (make asan): the processes' exit checks (leaks) have run; no report.
for p in "${pids[@]}"; do for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done; done
reports=$(grep -lE 'AddressSanitizer|LeakSanitizer|runtime error:' "$tmp"/*.log)
[ -z "$reports" ] && ok "no sanitizer report (router with its ZAP thread, nodes)" ||
  bad "no sanitizer report (router with its ZAP thread, nodes)" "$reports"
q1=$(free_port); q2=$(free_port); q3=$(free_port)
cat > "$tmp/up.yaml" <<YEOF
model: $model
run_dir: $tmp/mesh
bin_dir: $bin
start_timeout: 90
curve: true
router: {client: "tcp://127.0.0.1:$q1", node: "tcp://127.0.0.1:$q2", admin: "tcp://127.0.0.1:$q3", http_port: -1}
decode_nodes:
  - {name: dn}
YEOF
expect "pdmesh up with curve: true" 0 timeout 150 env -u PDMESH_CURVE_SERVER_KEY_FILE -u PDMESH_CURVE_KEY_FILE "$bin/pdmesh" up --config "$tmp/up.yaml"
[ "$(stat -c %a "$tmp/mesh/curve/server.key")" = 600 ] && [ "$(grep -c . "$tmp/mesh/curve/allow")" = 3 ] &&
  ok "pdmesh up: server key 0600, allowlist of 3 role keys" || bad "pdmesh up: server key 0600, allowlist of 3 role keys" "$(ls -l "$tmp/mesh/curve")"
expect "pdmesh generate --config over CURVE" 0 timeout 300 "$bin/pdmesh" generate --config "$tmp/up.yaml" --temp 0 -n 12 --prompt "$prompt" &&
  { [ "$(cat "$tmp/out")" = "$want" ] && ok "  ... equals the engine" || bad "  ... equals the engine" "$(cat "$tmp/out")"; }
expect "pdctl --config over CURVE" 0 env -u PDMESH_ADMIN_TOKEN_FILE "$bin/pdctl" --config "$tmp/up.yaml" --timeout 5000 nodes
contains "  ... lists the decode node" "$tmp/out" "dn"
expect "plain client refused by the pdmesh-up mesh" 1 timeout 60 "$bin/pdmesh" generate --router "tcp://127.0.0.1:$q1" --prompt hi -n 4 --timeout 30000
expect "pdmesh down" 0 timeout 60 "$bin/pdmesh" down --config "$tmp/up.yaml"
done_
