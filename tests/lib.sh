# shellcheck shell=bash
# tests/lib.sh - the check helpers the shell test scripts share (sourced; they set $tmp first).
#   ok NAME / bad NAME [DETAIL] / skip NAME      count and print a result
#   expect NAME STATUS CMD...                   run CMD (stdout, stderr in $tmp/out, $tmp/err)
#                                               and check its exit status
#   contains NAME FILE TEXT                     FILE holds TEXT
passed=0
failed=0
skipped=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; [ -n "${2:-}" ] && echo "     $2"; }
skip() { skipped=$((skipped + 1)); echo "skip $1"; }
expect() {
  local name=$1 want=$2
  shift 2
  "$@" >"$tmp/out" 2>"$tmp/err"
  local got=$?
  if [ "$got" -eq "$want" ]; then ok "$name"; return 0; fi
  bad "$name" "exit $got, expected $want; stderr: $(head -c 400 "$tmp/err")"
  return 1
}
contains() {
  if grep -qF -- "$3" "$2"; then ok "$1"; else bad "$1" "'$3' not in $2: $(head -c 300 "$2")"; fi
}
