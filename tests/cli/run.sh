#!/usr/bin/env bash
# CLI tests: drive the real pdmesh binary as a user would and check stdout, stderr and exit
# codes. Needs PDMESH (the binary) and PDMESH_MODEL (the real model; tests that need it are
# skipped with a message when it is absent).
set -u
bin=${PDMESH:-build/bin/pdmesh}
model=${PDMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/../lib.sh"

# ---- usage errors: exit 2 with a message ----
expect "no command" 2 "$bin"
expect "unknown command" 2 "$bin" frobnicate && contains "unknown command named" "$tmp/err" "frobnicate"
expect "unknown flag" 2 "$bin" generate --prompt x --no-such-flag
expect "missing prompt" 2 "$bin" generate --model "$model"
expect "negative temperature" 2 "$bin" generate --prompt x --temp -1 && contains "temp named" "$tmp/err" "--temp"
expect "top-p zero" 2 "$bin" generate --prompt x --top-p 0
expect "min-p above one" 2 "$bin" generate --prompt x --min-p 1.5
expect "non-numeric -n" 2 "$bin" generate --prompt x -n many
expect "bad kv dtype" 2 "$bin" generate --prompt x --kv-dtype q3
expect "help" 0 "$bin" --help && contains "help lists generate" "$tmp/out" "generate"

# ---- model errors: exit 1 naming the file ----
expect "missing model" 1 "$bin" generate --model "$tmp/none.gguf" --prompt x && contains "missing model named" "$tmp/err" "$tmp/none.gguf"
printf 'GGUF\003\000\000\000garbage' >"$tmp/corrupt.gguf"
expect "corrupt model" 1 "$bin" generate --model "$tmp/corrupt.gguf" --prompt x && contains "corrupt model named" "$tmp/err" "corrupt.gguf"
printf 'not a model at all' >"$tmp/text.gguf"
expect "not a gguf" 1 "$bin" tokenize --model "$tmp/text.gguf" hi && contains "bad magic reported" "$tmp/err" "text.gguf"

# ---- a random test model: the whole path without the real model ----
expect "make test model" 0 "$bin" make-test-model --out "$tmp/tiny.gguf" --layers 2 --d-model 64 --heads 4 --kv-heads 2
expect "generate on test model" 0 "$bin" generate --model "$tmp/tiny.gguf" --prompt "The quick brown fox" -n 8 --temp 0 --json
if $py -c 'import json,sys; d=json.load(open(sys.argv[1])); assert len(d["tokens"]) == 8, d' "$tmp/out"; then ok "test model json"; else bad "test model json"; fi
expect "generate q8 KV" 0 "$bin" generate --model "$tmp/tiny.gguf" --prompt "The quick brown fox" -n 8 --temp 0 --kv-dtype q8 --json
expect "test model tokenize" 0 "$bin" tokenize --model "$tmp/tiny.gguf" "the fox"
# ---- generate --turn: a conversation continued in one cache (docs/configuration.md) ----
expect "--turn with --chat refused" 2 "$bin" generate --model "$tmp/tiny.gguf" --prompt x --turn y --chat && contains "--turn with --chat named" "$tmp/err" "--turn"
expect "--turn with a q8 cache refused" 2 "$bin" generate --model "$tmp/tiny.gguf" --prompt x --turn y --kv-dtype q8 && contains "--turn with q8 named" "$tmp/err" "q8"
P1="The quick brown fox jumps over the lazy dog, and then it runs far away into the woods"
P3="Some other words entirely"
expect "turn 1 alone" 0 "$bin" generate --model "$tmp/tiny.gguf" --prompt "$P1" -n 6 --temp 0 --json && cp "$tmp/out" "$tmp/t1.json"
expect "another prompt alone" 0 "$bin" generate --model "$tmp/tiny.gguf" --prompt "$P3" -n 6 --temp 0 --json && cp "$tmp/out" "$tmp/t3.json"
P2="$P1$($py -c 'import json,sys; print(json.load(open(sys.argv[1]))["text"], end="")' "$tmp/t1.json") and so on"
expect "three turns" 0 "$bin" generate --model "$tmp/tiny.gguf" --prompt "$P1" --turn "$P2" --turn "$P3" --turn "$P3" -n 6 --temp 0 --json
if $py - "$tmp/out" "$tmp/t1.json" "$tmp/t3.json" <<'PYEOF'
import json, sys
t = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
one, three = json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
assert len(t) == 4 and [x["turn"] for x in t] == [0, 1, 2, 3], t
# turn 0 is a plain generate; turn 1 reuses the first prompt and the fed-back answer
assert t[0]["tokens"] == one["tokens"] and t[0]["cached_tokens"] == 0, (t[0], one)
assert 16 <= t[1]["cached_tokens"] < t[1]["prompt_tokens"], t[1]
assert t[1]["cached_tokens"] >= one["prompt_tokens"], (t[1], one["prompt_tokens"])
# an unrelated prompt shares nothing: prefilled in full, the same tokens as alone
assert t[2]["cached_tokens"] == 0 and t[2]["tokens"] == three["tokens"], (t[2], three)
# the same prompt again: all but its last token reused, or none under 16 tokens
n3 = t[3]["prompt_tokens"]
assert t[3]["cached_tokens"] == (n3 - 1 if n3 - 1 >= 16 else 0), t[3]
PYEOF
then ok "--turn: a JSON line per turn, the prompt and fed-back answer reused, nothing of an unrelated prompt"; else bad "--turn checks" "$(head -c 600 "$tmp/out")"; fi
expect "the same long prompt twice" 0 "$bin" generate --model "$tmp/tiny.gguf" --prompt "$P1" --turn "$P1" -n 6 --temp 0 --json
if $py -c 'import json,sys; t=[json.loads(l) for l in open(sys.argv[1])]; assert t[1]["cached_tokens"] == t[1]["prompt_tokens"] - 1, t' "$tmp/out"; then ok "--turn: a repeated prompt reuses all but its last token"; else bad "--turn repeated prompt" "$(head -c 400 "$tmp/out")"; fi
# ---- weight types: make-test-model --wtype, pdmesh quantize ----
expect "unknown wtype" 2 "$bin" make-test-model --out "$tmp/x.gguf" --wtype q7_z && contains "unknown wtype named" "$tmp/err" "q7_z"
expect "k type needs 256 columns" 1 "$bin" make-test-model --out "$tmp/x.gguf" --wtype q4_k && contains "block size named" "$tmp/err" "q4_k (256)"
expect "make q4_k model" 0 "$bin" make-test-model --out "$tmp/k.gguf" --layers 1 --d-model 256 --ffn 256 --wtype q4_k --emb-type q6_k
expect "generate on q4_k model" 0 "$bin" generate --model "$tmp/k.gguf" --prompt "The quick" -n 4 --temp 0
expect "make f32 model" 0 "$bin" make-test-model --out "$tmp/f32.gguf" --layers 1 --d-model 256 --ffn 256 --wtype f32 --emb-type f32
expect "quantize q4_k_m" 0 "$bin" quantize "$tmp/f32.gguf" "$tmp/q4km.gguf" q4_k_m
expect "generate on quantized" 0 "$bin" generate --model "$tmp/q4km.gguf" --prompt "The quick" -n 4 --temp 0
expect "quantize usage" 2 "$bin" quantize "$tmp/f32.gguf"
expect "quantize bad type" 1 "$bin" quantize "$tmp/f32.gguf" "$tmp/y.gguf" q7_z && contains "quantize lists types" "$tmp/err" "iq4_xs"
expect "requantize refused" 1 "$bin" quantize "$tmp/q4km.gguf" "$tmp/y.gguf" q8_0 && contains "requantize named" "$tmp/err" "already"
# ---- pdmesh perplexity / kld on the test model (docs/fidelity.md) ----
# (a random model's distributions are so peaked that most targets fall below the base file's
# 16-nat floor: its PPL(base) means nothing, so only the KL figures are checked here)
text=tests/golden/ppl_text.txt
[ -f "$text" ] || text="$(dirname "$0")/../golden/ppl_text.txt"
expect "perplexity needs --file" 2 "$bin" perplexity --model "$tmp/tiny.gguf"
expect "kl-divergence needs a base" 2 "$bin" perplexity --model "$tmp/tiny.gguf" --kl-divergence
expect "perplexity bad kv dtype" 2 "$bin" perplexity --model "$tmp/tiny.gguf" --file "$text" --kv-dtype q8
expect "perturb needs --exact" 2 "$bin" perplexity --model "$tmp/tiny.gguf" --file "$text" --perturb 1e-6
expect "kld needs two files" 2 "$bin" kld "$tmp/tiny.gguf"
expect "kld on a non-base file" 1 "$bin" kld "$tmp/tiny.gguf" "$tmp/tiny.gguf" && contains "kld names the bad file" "$tmp/err" "not a log-probability file"
expect "perplexity missing text" 1 "$bin" perplexity --model "$tmp/tiny.gguf" --file "$tmp/none.txt" && contains "missing text named" "$tmp/err" "none.txt"
printf 'a short text' >"$tmp/short.txt"
expect "perplexity text too short" 1 "$bin" perplexity --model "$tmp/tiny.gguf" --file "$tmp/short.txt" && contains "too short explained" "$tmp/err" "at least"
expect "perplexity on test model" 0 "$bin" perplexity --model "$tmp/tiny.gguf" --file "$text" --ctx 64 --chunks 3 --threads 2
if grep -Eq '^\[1\][0-9]+\.[0-9]{4},\[2\][0-9]+\.[0-9]{4},\[3\][0-9]+\.[0-9]{4},$' "$tmp/out" && grep -Eq '^Final estimate: PPL = [0-9]+\.[0-9]{4} \+/- [0-9]+\.[0-9]{5}$' "$tmp/out"; then ok "perplexity output shape"; else bad "perplexity output shape" "$(head -c 300 "$tmp/out")"; fi
ppl_json() { # NAME ARGS...: perplexity --json into $tmp/NAME.json
  local name=$1; shift
  expect "perplexity $name" 0 "$bin" perplexity --model "$tmp/tiny.gguf" --file "$text" --ctx 64 --chunks 3 --json "$@" && cp "$tmp/out" "$tmp/$name.json"
}
ppl_json t1 --threads 1
ppl_json t2 --threads 2 --kl-divergence-base "$tmp/tiny.kld"
ppl_json b7 --threads 2 --batch 7
ppl_json exact --exact --threads 2 --kl-divergence-base "$tmp/tiny-exact.kld"
if $py - "$tmp" <<'PY'
import json, sys
d = {n: json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("t1", "t2", "b7", "exact")}
t1 = d["t1"]
assert t1["chunks"] == 3 and t1["n_ctx"] == 64 and t1["scored"] == 3 * 31 and len(t1["per_chunk"]) == 3, t1
assert t1["ppl"] > 1 and t1["ppl_err"] > 0 and abs(t1["per_chunk"][-1]["running_ppl"] - t1["ppl"]) < 1e-9, t1
for n in ("t2", "b7"):  # threads and batch size do not change the perplexity
    assert abs(d[n]["ppl"] / t1["ppl"] - 1) < 1e-3, (n, d[n]["ppl"], t1["ppl"])
assert d["exact"]["forward"] == "exact-f64" and abs(d["exact"]["ppl"] / t1["ppl"] - 1) < 0.05, d["exact"]
PY
then ok "perplexity json, threads and batch agree, exact close"; else bad "perplexity json, threads and batch agree, exact close"; fi
expect "kld of a base with itself" 0 "$bin" kld "$tmp/tiny.kld" "$tmp/tiny.kld" --json
if $py -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["kld_mean"]==0 and d["same_top"]==1 and d["positions"]==93, d' "$tmp/out"; then ok "kld self is zero"; else bad "kld self is zero" "$(head -c 300 "$tmp/out")"; fi
expect "kl-divergence against own base" 0 "$bin" perplexity --model "$tmp/tiny.gguf" --kl-divergence --kld-base "$tmp/tiny.kld" --json
if $py -c 'import json,sys; d=json.load(open(sys.argv[1])); assert -1e-6 < d["kld_mean"] < 1e-5 and d["same_top"] >= 0.98 and d["positions"] == 93, d' "$tmp/out"; then ok "kl-divergence vs own base ~0"; else bad "kl-divergence vs own base ~0" "$(head -c 300 "$tmp/out")"; fi
expect "kld engine vs exact" 0 "$bin" kld "$tmp/tiny-exact.kld" "$tmp/tiny.kld" --json
if $py -c 'import json,sys; d=json.load(open(sys.argv[1])); assert -1e-6 < d["kld_mean"] < 0.05 and d["same_top"] >= 0.9, d' "$tmp/out"; then ok "kld engine vs exact small"; else bad "kld engine vs exact small" "$(head -c 300 "$tmp/out")"; fi
expect "kl-divergence --ctx mismatch" 1 "$bin" perplexity --model "$tmp/tiny.gguf" --kl-divergence --kld-base "$tmp/tiny.kld" --ctx 128
head -c $(( $(wc -c <"$tmp/tiny.kld") - 100 )) "$tmp/tiny.kld" >"$tmp/trunc.kld"
expect "kld truncated base" 1 "$bin" kld "$tmp/tiny.kld" "$tmp/trunc.kld" && contains "truncation explained" "$tmp/err" "trunc.kld"

# ---- pdmesh plan (memory of each KV placement) ----
expect "plan needs context" 2 "$bin" plan --model "$tmp/tiny.gguf"
expect "plan bad budget" 2 "$bin" plan --model "$tmp/tiny.gguf" --context 100 --fast-budget lots
expect "plan json" 0 "$bin" plan --model "$tmp/tiny.gguf" --context 65536 --beams 2 --fast-budget 40M --json
if $py -c '
import json,sys
d=json.load(open(sys.argv[1])); p={r["name"]:r for r in d["placements"]}
assert set(p)=={"all-resident","layer-wise","head-wise","head-wise+resident"}, p
assert p["head-wise"]["kv_fast"] < p["layer-wise"]["kv_fast"] <= p["all-resident"]["kv_fast"], p  # 2 layers: layer-wise ping-pong = all layers
assert p["head-wise"]["max_context_in_budget"] > p["layer-wise"]["max_context_in_budget"] >= p["all-resident"]["max_context_in_budget"], p
assert p["head-wise+resident"]["kv_fast"] <= 40*1048576, p
' "$tmp/out"; then ok "plan placements ordered"; else bad "plan placements ordered" "$(head -c 600 "$tmp/out")"; fi
expect "plan table" 0 "$bin" plan --model "$tmp/tiny.gguf" --context 4096 && contains "plan names head-wise" "$tmp/out" "head-wise"
# KV per layer kind (windowed local layers on the decode node): gemma3 preset, window 16
expect "plan bad kv-window" 2 "$bin" plan --model "$tmp/tiny.gguf" --context 100 --kv-window 1.2 && contains "kv-window named" "$tmp/err" "--kv-window"
expect "make gemma3 model" 0 "$bin" make-test-model --arch gemma3 --out "$tmp/g3.gguf"
expect "plan layer kinds" 0 "$bin" plan --model "$tmp/g3.gguf" --context 1000 && contains "plan local row" "$tmp/out" "local"
expect "plan layer kinds json" 0 "$bin" plan --model "$tmp/g3.gguf" --context 1000 --json
if $py -c '
import json,sys
k=json.load(open(sys.argv[1]))["kv_layers"]
assert k["window"]==16 and k["local"]["layers"]==6 and k["global"]["layers"]==1, k
assert k["local"]["rows_per_head"]==30 and k["bytes"] < k["bytes_full_kv"], k
assert k["bytes"]==k["local"]["bytes"]+k["global"]["bytes"], k
' "$tmp/out"; then ok "plan kv_layers: local layers in 30 rows, less than full KV"; else bad "plan kv_layers" "$(head -c 600 "$tmp/out")"; fi
expect "plan kv-window 0 is full KV" 0 "$bin" plan --model "$tmp/g3.gguf" --context 1000 --kv-window 0 --json
if $py -c '
import json,sys
k=json.load(open(sys.argv[1]))["kv_layers"]
assert k["bytes"]==k["bytes_full_kv"] and k["local"]["rows_per_head"]==1000, k
' "$tmp/out"; then ok "plan --kv-window 0: local layers keep the context"; else bad "plan --kv-window 0" "$(head -c 600 "$tmp/out")"; fi
expect "disagg-run bad kv-window" 2 "$bin" disagg-run --prefill-ranks 1 --method single --random 8 --kv-window 9 && contains "disagg kv-window named" "$tmp/err" "--kv-window"
# the reference GGUF reader (the gguf package from llama.cpp's authors) reads our writer's file
if $py -c 'import gguf' 2>/dev/null; then
  if $py - "$tmp/tiny.gguf" <<'PY'
import sys, gguf
r = gguf.GGUFReader(sys.argv[1])
names = {t.name: t for t in r.tensors}
assert len(names) == 1 + 1 + 2 * 9, sorted(names)
assert names["blk.1.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
assert list(names["blk.0.attn_k.weight"].shape) == [64, 32], names["blk.0.attn_k.weight"].shape
f = r.fields["llama.attention.head_count_kv"]
assert int(f.parts[f.data[0]][0]) == 2
PY
  then ok "gguf-py reads our file"; else bad "gguf-py reads our file"; fi
else
  echo "skip gguf-py cross-check: the gguf package is not installed (make deps)"
  skipped=$((skipped + 1))
fi

if [ ! -f "$model" ]; then
  echo "skip real-model CLI tests: $model not present (run 'make model')"
  skipped=$((skipped + 1))
else
  # ---- generate ----
  expect "generate France" 0 "$bin" generate --model "$model" --prompt "The capital of France is" -n 20 --temp 0
  contains "continuation mentions Paris" "$tmp/out" "Paris"
  [ ! -s "$tmp/err" ] && ok "stderr quiet without --stats" || bad "stderr quiet without --stats" "$(head -c 200 "$tmp/err")"

  expect "generate --stats" 0 "$bin" generate --model "$model" --prompt "Hello" -n 8 --temp 0 --stats
  contains "stats TTFT" "$tmp/err" "TTFT"
  contains "stats decode" "$tmp/err" "decode:"

  expect "generate --json" 0 "$bin" generate --model "$model" --prompt "Count: 1, 2, 3," -n 12 --temp 0 --json
  if $py - "$tmp/out" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().strip().splitlines()
assert len(lines) == 1, lines
d = json.loads(lines[0])
assert d["completion_tokens"] == len(d["tokens"]) <= 12, d
assert d["prompt_tokens"] > 0 and d["ttft_s"] > 0 and d["decode_tokens_per_s"] > 0, d
assert isinstance(d["text"], str) and d["finish_reason"] in ("stop", "length"), d
PY
  then ok "json object"; else bad "json object"; fi

  expect "seeded sampling 1" 0 "$bin" generate --model "$model" --prompt "Once upon a time" -n 16 --temp 0.9 --seed 7
  cp "$tmp/out" "$tmp/seed1"
  expect "seeded sampling 2" 0 "$bin" generate --model "$model" --prompt "Once upon a time" -n 16 --temp 0.9 --seed 7
  cmp -s "$tmp/out" "$tmp/seed1" && ok "same seed, same text" || bad "same seed, same text"

  expect "stop string" 0 "$bin" generate --model "$model" --prompt "The capital of France is" -n 30 --temp 0 --stop "." --json
  if $py -c 'import json,sys; d=json.load(open(sys.argv[1])); assert "." not in d["text"] and d["finish_reason"]=="stop", d' "$tmp/out"; then ok "stop string honoured"; else bad "stop string honoured"; fi

  expect "chat" 0 "$bin" generate --model "$model" --chat --prompt "What is 2+2? Answer with one word." -n 16 --temp 0
  [ -s "$tmp/out" ] && ok "chat produced text" || bad "chat produced text"

  long=$(printf 'word %.0s' $(seq 1 300))
  expect "prompt longer than context" 1 "$bin" generate --model "$model" --prompt "$long" --ctx 64
  contains "context error explains" "$tmp/err" "context"

  # ---- perplexity on the real model: output, JSON, threads and batch sizes agree ----
  rppl() { # NAME ARGS...
    local name=$1; shift
    expect "real perplexity $name" 0 "$bin" perplexity --model "$model" --file "$text" --ctx 128 --chunks 2 --json "$@" && cp "$tmp/out" "$tmp/r$name.json"
  }
  rppl t1 --threads 1
  rppl t2 --threads 2 --kl-divergence-base "$tmp/pdm.kld"
  rppl b16 --threads 2 --batch 16
  rppl exact --threads 2 --exact --kl-divergence-base "$tmp/exact.kld"
  if $py - "$tmp" <<'PY'
import json, sys
d = {n: json.load(open(f"{sys.argv[1]}/r{n}.json")) for n in ("t1", "t2", "b16", "exact")}
assert d["t1"]["scored"] == 2 * 63 and d["t1"]["bos"] is False, d["t1"]
for n in ("t2", "b16"):
    assert abs(d[n]["ppl"] / d["t1"]["ppl"] - 1) < 1e-3, (n, d[n]["ppl"], d["t1"]["ppl"])
assert abs(d["exact"]["ppl"] / d["t1"]["ppl"] - 1) < 0.03, (d["exact"]["ppl"], d["t1"]["ppl"])
PY
  then ok "real perplexity: threads, batch agree; exact within 3 %"; else bad "real perplexity: threads, batch agree; exact within 3 %"; fi

  # ---- against llama.cpp (llama-cpp-python): the same tokens, KL divergence bounded ----
  # The issue's bars (mean KLD <= 0.002, same top >= 98 %) are measured by make fidelity: they
  # do not hold for any engine with 8-bit activations that is not bit-identical to llama.cpp
  # (docs/perf/fidelity.md). What must hold, and fails on a real bug (BOS, RoPE, a wrong
  # kernel: KLD well above 0.05): pdmesh is about as close to the exact model as llama.cpp is,
  # and close to llama.cpp in absolute terms.
  if $py -c 'import llama_cpp' 2>/dev/null; then
    if $py tests/golden/make_kld_base.py --model "$model" --file "$text" --ctx 128 --chunks 2 --out "$tmp/llama.kld" >/dev/null 2>"$tmp/err"; then
      ok "make_kld_base.py"
      expect "kl-divergence vs llama.cpp" 0 "$bin" perplexity --model "$model" --kl-divergence --kld-base "$tmp/llama.kld" --json && cp "$tmp/out" "$tmp/vs_llama.json"
      expect "kld exact vs llama.cpp" 0 "$bin" kld "$tmp/exact.kld" "$tmp/llama.kld" --json && cp "$tmp/out" "$tmp/exact_llama.json"
      expect "kld exact vs pdmesh" 0 "$bin" kld "$tmp/exact.kld" "$tmp/pdm.kld" --json && cp "$tmp/out" "$tmp/exact_pdm.json"
      if $py - "$tmp" <<'PY'
import json, sys
t = sys.argv[1]
vl, el, ep = (json.load(open(f"{t}/{n}.json")) for n in ("vs_llama", "exact_llama", "exact_pdm"))
print(f"     pdmesh vs llama.cpp: KLD {vl['kld_mean']:.5f}, same top {100*vl['same_top']:.1f} %, "
      f"PPL ratio {vl['ppl_ratio']:.4f}; exact->pdmesh {ep['kld_mean']:.5f}, exact->llama.cpp {el['kld_mean']:.5f}")
assert vl["positions"] == 126, vl
assert vl["kld_mean"] < 0.01 and vl["kld_max"] < 0.2 and vl["same_top"] >= 0.9, vl
assert abs(vl["ppl_ratio"] - 1) < 0.03, vl
assert ep["kld_mean"] < 2 * el["kld_mean"] + 0.001, (ep, el)
PY
      then ok "pdmesh vs llama.cpp and exact within bounds"; else bad "pdmesh vs llama.cpp and exact within bounds"; fi
    else
      bad "make_kld_base.py" "$(tail -c 400 "$tmp/err")"
    fi
  else
    skip "pdmesh vs llama.cpp KL divergence: llama_cpp is not importable by $py (tools/deps.sh build/venv --golden)"
  fi

  # ---- tokenize / detokenize ----
  expect "tokenize" 0 "$bin" tokenize --model "$model" "Hello world"
  contains "tokenize ids" "$tmp/out" "19556 905"
  echo -n "Héllo, 世界 🙂" | "$bin" tokenize --model "$model" - >"$tmp/ids" 2>"$tmp/err" && ok "tokenize stdin" || bad "tokenize stdin"
  "$bin" detokenize --model "$model" $(cat "$tmp/ids") >"$tmp/text" 2>"$tmp/err" && ok "detokenize" || bad "detokenize"
  [ "$(cat "$tmp/text")" = "Héllo, 世界 🙂" ] && ok "round trip" || bad "round trip" "$(cat "$tmp/text")"
  expect "tokenize --special" 0 "$bin" tokenize --model "$model" --special "<|im_start|>user"
  contains "special id parsed" "$tmp/out" "1 "
  expect "detokenize bad id" 1 "$bin" detokenize --model "$model" 999999
  expect "detokenize not a number" 2 "$bin" detokenize --model "$model" abc
fi


# ---- the daemons and group commands on the test model (real processes, UCX) ----
dir=$(dirname "$bin")
prefilld="$dir/pdmesh-prefill"
decoded="$dir/pdmesh-decode"
if [ -x "$prefilld" ] && [ -x "$decoded" ]; then
  expect "prefill-run kvr-e" 0 "$bin" prefill-run --model "$tmp/tiny.gguf" --ranks 2 --method kvr-e --random 40 --json
  if $py -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["method"]=="kvr-e" and d["prompt_tokens"]==40 and len(d["per_rank"])==2 and d["ttft"]>0, d' "$tmp/out"; then ok "prefill-run json"; else bad "prefill-run json"; fi
  expect "prefill-run plan" 0 "$bin" prefill-run --model "$tmp/tiny.gguf" --ranks 2 --method auto --random 300 --cached 290 --plan
  contains "plan names pass-Q rule" "$tmp/out" "cp-"
  expect "prefill-run too short for tsp" 1 "$bin" prefill-run --model "$tmp/tiny.gguf" --ranks 3 --method tsp --random 2
  contains "tsp refusal explained" "$tmp/err" "at least one token per rank"
  expect "prefill-run bad method" 2 "$bin" prefill-run --model "$tmp/tiny.gguf" --ranks 2 --method ring --random 8
  expect "prefill-run bad partition" 2 "$bin" prefill-run --model "$tmp/tiny.gguf" --ranks 2 --method kvr-s --partition 3 --random 8
  expect "kvr-p without table" 1 "$bin" prefill-run --model "$tmp/tiny.gguf" --ranks 2 --method kvr-p --random 8
  contains "kvr-p needs a table" "$tmp/err" "partition table"
  expect "disagg-run" 0 "$bin" disagg-run --model "$tmp/tiny.gguf" --prefill-ranks 2 --method cp-kv --prompt "the fox" --prompt "a dog" -n 6 --json
  if $py -c '
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
assert len(rows)==2 and all(len(r["token_ids"])>=1 and r["kv_bytes"]>0 for r in rows), rows' "$tmp/out"; then ok "disagg-run json"; else bad "disagg-run json"; fi
  # Every architecture's preset: disagg-run (2-rank group, each preset another method, KV
  # streamed to a decode node) gives the engine's greedy tokens (pdmesh generate --temp 0).
  for am in llama3:tsp qwen2:cp-q qwen3:cp-kv gemma3:kvr-e; do
    a=${am%%:*} meth=${am#*:}
    "$bin" make-test-model --arch "$a" --seed 1 --out "$tmp/arch-$a.gguf" >/dev/null 2>&1
    ap="the quick brown fox jumps over the lazy dog while the small cat sleeps near the window"
    "$bin" generate --model "$tmp/arch-$a.gguf" --prompt "$ap" -n 12 --temp 0 --json >"$tmp/arch-ref.json" 2>/dev/null
    expect "disagg-run $a $meth" 0 "$bin" disagg-run --model "$tmp/arch-$a.gguf" --prefill-ranks 2 --method "$meth" --prompt "$ap" -n 12 --temp 0 --json
    if $py -c '
import json,sys
ref=json.load(open(sys.argv[1])); got=json.loads(open(sys.argv[2]).read().splitlines()[-1])
assert len(ref["tokens"])>=6 and got["token_ids"]==ref["tokens"], (got["token_ids"], ref["tokens"])' "$tmp/arch-ref.json" "$tmp/out"; then ok "disagg-run $a = engine's greedy tokens"; else bad "disagg-run $a = engine's greedy tokens" "$(head -c 400 "$tmp/out")"; fi
  done
  # int8 KV end to end: the stream carries half of f16's bytes, the same tokens' count
  expect "disagg-run f16" 0 "$bin" disagg-run --model "$tmp/tiny.gguf" --prefill-ranks 2 --method kvr-e --prompt "the quick brown fox" -n 4 --temp 0 --kv-dtype f16 --json
  cp "$tmp/out" "$tmp/f16.json"
  expect "disagg-run q8" 0 "$bin" disagg-run --model "$tmp/tiny.gguf" --prefill-ranks 2 --method kvr-e --prompt "the quick brown fox" -n 4 --temp 0 --kv-dtype q8 --json
  if $py -c '
import json,sys
a=json.loads(open(sys.argv[1]).readline()); b=json.loads(open(sys.argv[2]).readline())
assert b["kv_dtype"]=="q8" and 2*b["kv_bytes"]==a["kv_bytes"] and len(b["token_ids"])==4, (a, b)' "$tmp/f16.json" "$tmp/out"; then ok "disagg-run q8 halves KV bytes"; else bad "disagg-run q8 halves KV bytes" "$(cat "$tmp/out")"; fi
  expect "disagg-run bad kv dtype" 2 "$bin" disagg-run --model "$tmp/tiny.gguf" --prefill-ranks 2 --method kvr-e --prompt "x" --kv-dtype int4
  # beam search on the decode node: n-best list with scores, best first; KV memory = eq. (3)
  expect "disagg-run beams" 0 "$bin" disagg-run --model "$tmp/tiny.gguf" --prefill-ranks 2 --method kvr-e --prompt "the fox" -n 20 --beams 3 --n-best 2 --length-penalty 0.5 --json
  if $py -c '
import json,sys
r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
nb, b = r["n_best"], r["beam"]
assert len(nb)==2 and nb[0]["score"]>=nb[1]["score"] and nb[0]["tokens"]==r["token_ids"], r
for h in nb:
    n=len(h["tokens"]); assert abs(h["score"]-h["logprob"]/n**0.5) < 1e-6*max(1,abs(h["score"])), h
assert b["width"]==3 and b["kv_prompt_bytes"]+b["kv_response_bytes"]==b["kv_bytes_eq3"], b
assert b["kv_response_bytes"] % (3*16) == 0 and b["n_response"] >= 1, b' "$tmp/out"; then ok "disagg-run beams json"; else bad "disagg-run beams json" "$(head -c 600 "$tmp/out")"; fi
  expect "disagg-run bad --beams" 2 "$bin" disagg-run --model "$tmp/tiny.gguf" --prefill-ranks 2 --method kvr-e --prompt "x" --beams 9
  expect "disagg-run n-best above beams" 2 "$bin" disagg-run --model "$tmp/tiny.gguf" --prefill-ranks 2 --method kvr-e --prompt "x" --beams 2 --n-best 3
  expect "decode daemon bad --beams" 2 "$decoded" --beams 12
  # head-wise KV offload on the decode node: same tokens as all-resident, budget respected
  expect "make 6-layer test model" 0 "$bin" make-test-model --out "$tmp/tiny6.gguf" --layers 6 --d-model 64 --heads 4 --kv-heads 2
  expect "disagg-run resident" 0 "$bin" disagg-run --model "$tmp/tiny6.gguf" --prefill-ranks 2 --method cp-kv --prompt "the quick fox" --prompt "a dog" -n 8 --json
  cp "$tmp/out" "$tmp/resident.json"
  expect "disagg-run offload" 0 "$bin" disagg-run --model "$tmp/tiny6.gguf" --prefill-ranks 2 --method cp-kv --prompt "the quick fox" --prompt "a dog" -n 8 --json --kv-fast-budget 8192 --kv-slow-tier "file:$tmp"
  if $py -c '
import json,sys
a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]
assert [r["token_ids"] for r in a]==[r["token_ids"] for r in b], (a, b)
for r in b:
    o=r["offload"]
    assert o["fast_peak"]<=8192 and o["offloaded_heads"]>0 and o["prefetches"]>0 and o["slow_peak"]>0, o
' "$tmp/resident.json" "$tmp/out"; then ok "disagg-run offload equal tokens + report"; else bad "disagg-run offload equal tokens + report" "$(head -c 600 "$tmp/out")"; fi
  expect "offload slow tier needs budget" 2 "$bin" disagg-run --model "$tmp/tiny6.gguf" --prefill-ranks 1 --method single --prompt x --kv-slow-tier ram
  expect "offload bad slow tier" 2 "$bin" disagg-run --model "$tmp/tiny6.gguf" --prefill-ranks 1 --method single --prompt x --kv-fast-budget 8192 --kv-slow-tier disk
  expect "decode daemon slow tier without budget" 2 "$decoded" --kv-slow-tier ram2
  if [ -f "$model" ]; then
    expect "disagg-run real resident" 0 "$bin" disagg-run --model "$model" --prefill-ranks 2 --method kvr-e --random 300 -n 12 --json
    cp "$tmp/out" "$tmp/resident.json"
    expect "disagg-run real offload" 0 "$bin" disagg-run --model "$model" --prefill-ranks 2 --method kvr-e --random 300 -n 12 --json --kv-fast-budget 1000000
    if $py -c '
import json,sys
a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]
assert a[0]["token_ids"]==b[0]["token_ids"] and b[0]["offload"]["fast_peak"]<=1000000 and b[0]["offload"]["offloaded_heads"]>0, (a, b)
' "$tmp/resident.json" "$tmp/out"; then ok "disagg-run real model offload equal tokens"; else bad "disagg-run real model offload equal tokens" "$(head -c 600 "$tmp/out")"; fi
    # int8 KV under offload: the scales travel with the heads' rows (the same tokens as q8
    # all resident)
    expect "disagg-run real q8 resident" 0 "$bin" disagg-run --model "$model" --prefill-ranks 2 --method kvr-e --random 300 -n 12 --json --kv-dtype q8
    cp "$tmp/out" "$tmp/resident.json"
    expect "disagg-run real q8 offload" 0 "$bin" disagg-run --model "$model" --prefill-ranks 2 --method kvr-e --random 300 -n 12 --json --kv-dtype q8 --kv-fast-budget 500000
    if $py -c '
import json,sys
a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]
assert a[0]["token_ids"]==b[0]["token_ids"] and b[0]["offload"]["fast_peak"]<=500000 and b[0]["offload"]["offloaded_heads"]>0, (a, b)
' "$tmp/resident.json" "$tmp/out"; then ok "disagg-run real model q8 offload equal tokens"; else bad "disagg-run real model q8 offload equal tokens" "$(head -c 600 "$tmp/out")"; fi
  fi
  # the daemons take their tasks only from a node socket (malformed frames sent to them:
  # tests/unit/test_nodeproto.c)
  expect "prefill daemon without --router" 2 "$prefilld" --model "$tmp/tiny.gguf"
  if grep -q -- "--router" "$tmp/err"; then ok "prefill daemon names --router"; else bad "prefill daemon names --router" "$(head -c 300 "$tmp/err")"; fi
  expect "decode daemon without --router" 2 "$decoded" --model "$tmp/tiny.gguf"
  expect "prefill daemon bad option" 2 "$prefilld" --threads 0
  expect "decode daemon bad option" 2 "$decoded" --kv-dtype q3
else
  skipped=$((skipped + 1)); echo "skip daemons (binaries not next to $bin)"
fi

# ---- Gemma 3 270M (SentencePiece, Gemma chat format): greedy tokens equal llama.cpp's ----
# tests/golden/tok_golden.json's gemma3_generate: llama.cpp's greedy continuation of a chat
# prompt (rendered with llama.cpp's built-in gemma format) and two plain prompts, with the gap
# between the two best logits at each step. pdmesh must produce the same tokens up to the end
# or up to a step where llama.cpp's two best logits are within 0.5 (a near-tie that Q4_K
# rounding may flip); the prompt lengths must be equal (the unit test compares the ids).
gemma=${PDMESH_GEMMA:-models/gemma-3-270m-q4_k_m.gguf}
golden=tests/golden/tok_golden.json
[ -f "$golden" ] || golden="$(dirname "$0")/../golden/tok_golden.json"
expect "unknown chat template name" 2 "$bin" generate --prompt x --chat --chat-template nope && contains "unknown chat template named" "$tmp/err" "nope"
expect "chat template on a remote generate" 2 "$bin" generate --mesh --prompt x --chat-template gemma && contains "remote chat template names the router" "$tmp/err" "pdmesh-router"
if [ -f "$gemma" ]; then
  for i in 0 1 2; do
    read -r chat prompt < <($py -c '
import json,sys; g=json.load(open(sys.argv[1]))["gemma3_generate"][int(sys.argv[2])]
print(int(g["chat"]), json.dumps(g["prompt"]))' "$golden" "$i")
    prompt=$($py -c 'import json,sys; print(json.loads(sys.argv[1]))' "$prompt")
    args=(generate --model "$gemma" --prompt "$prompt" -n 24 --temp 0 --json)
    [ "$chat" = 1 ] && args+=(--chat)
    expect "gemma generate $i" 0 "$bin" "${args[@]}"
    if $py -c '
import json,sys
g=json.load(open(sys.argv[1]))["gemma3_generate"][int(sys.argv[2])]; d=json.load(open(sys.argv[3]))
assert d["prompt_tokens"]==len(g["prompt_ids"]), (d["prompt_tokens"], len(g["prompt_ids"]))
n=0
for i,(a,b) in enumerate(zip(d["tokens"], g["greedy"])):
    if a!=b:
        assert g["gaps"][i] < 0.5, ("step", i, a, b, g["gaps"][i])
        break
    n+=1
assert n >= 8 or n == len(g["greedy"]), (n, d["tokens"], g["greedy"])
print(n, "of", len(g["greedy"]), "tokens equal", file=sys.stderr)
' "$golden" "$i" "$tmp/out" 2>"$tmp/cmp"; then ok "gemma greedy $i equals llama.cpp ($(cat "$tmp/cmp"))"; else bad "gemma greedy $i equals llama.cpp" "$(tail -c 600 "$tmp/cmp")"; fi
  done
  expect "gemma tokenize" 0 "$bin" tokenize --model "$gemma" --special $'<start_of_turn>user\nHi<end_of_turn>'
  contains "gemma special tokens" "$tmp/out" "105 2364 107 10979 106"
else
  skip "Gemma 3 270M (not in models/: make model MODEL=gemma3-270m)"
fi

echo "cli: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
