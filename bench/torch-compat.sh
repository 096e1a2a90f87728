#!/usr/bin/env bash
# The torch compatibility check, one command: bench/torch-compat.sh VERSION...
#   e.g. bench/torch-compat.sh 2.15.0 2.6.0 2.4.1
#
# For each torch VERSION, one after the other (they would share the same cores):
#   1. a fresh venv (under ${RDZV_COMPAT_DIR:-~/.cache/rdzv-torch-compat}, removed afterwards
#      unless KEEP_VENVS=1) with torch==VERSION and numpy, then this project with its test
#      extras (`pip install -e ".[test]"`, without constraints-test.txt: that file pins torch);
#   2. the torch-facing tests (TORCH_TESTS below) with that torch;
#   3. one real two-node job: a memory-only server on a free loopback port and two agents
#      running the quick start's hello.py (README), through `rdzv-torchrun` on every torch
#      and through plain `torchrun` where torch reads the torchrun.handlers entry point (2.6+).
# Then it prints one table, version | tests | jobs; logs go to bench/out/torch-compat/VERSION/.
# Exit status 0 only when every version passed everything.
#
# It downloads torch (CUDA builds of several GB from PyPI for releases not on local disk), so
# it is a maintainer's command, not part of .ci/run. pip's configuration is kept (indexes,
# certificates) except any `constraint`: a machine-wide cap such as torch<=2.14.1 would refuse
# the very versions this command is asked to check.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT="$ROOT/bench/out/torch-compat"
BASE="${RDZV_COMPAT_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rdzv-torch-compat}"
PYTHON="${PYTHON:-python3}"
# The tests that touch torch: real torchrun agents, the Store, the handler (tests/e2e), the
# backend's registration and rdzv-torchrun (test_plugin), torch's exit-barrier keys the server
# watches (test_torch_exit_barrier), the handler's TLS options, and what the failure report
# relies on in torch's agent (test_failure_report: docs/torch-compat.md).
TORCH_TESTS=(
  tests/e2e
  tests/unit/test_plugin.py
  tests/unit/test_torch_exit_barrier.py
  tests/unit/test_failure_report.py
  tests/integration/test_server_tls.py::test_the_torchrun_handlers_client_options_come_from_rdzv_conf
)
JOB_TIMEOUT=300   # seconds for one two-node job; a clean one takes a few

if [ $# -eq 0 ]; then
  echo "usage: $0 TORCH_VERSION... (e.g. $0 2.15.0 2.6.0 2.4.1)" >&2
  exit 2
fi

# pip's own settings minus any constraint, as PIP_* variables; PIP_CONFIG_FILE=/dev/null then
# makes pip read no configuration file (where the constraint lives).
pip_env() {
  "$PYTHON" - <<'PY'
import shlex, subprocess, sys, ast
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
seen = {}
for line in listed.splitlines():
    key, sep, value = line.partition("=")
    if not sep or key.startswith(":env:"):
        continue  # PIP_* variables already set stay set
    name = key.split(".", 1)[-1]
    if name in ("constraint", "constraints"):
        continue
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass
    seen["PIP_" + name.upper().replace("-", "_")] = str(value)
for var, value in seen.items():
    print(f"export {var}={shlex.quote(value)}")
PY
}

# The quick start's hello.py (README); the job checks what it prints.
HELLO=$(cat <<'PY'
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())]); dist.all_reduce(t)
print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} on node {os.environ['GROUP_RANK']}: sum={t.item()}")
dist.destroy_process_group()
PY
)

# install VERSION VENV: a fresh venv with torch==VERSION, numpy and the project's test extras.
install() {
  local version=$1 venv=$2
  eval "$(pip_env)" || return 1
  export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
  unset PIP_CONSTRAINT
  "$PYTHON" -m venv "$venv" \
    && "$venv/bin/pip" install "torch==$version" numpy \
    && "$venv/bin/pip" install -e "$ROOT[test]" "torch==$version"
}

# job VENV LAUNCHER LOGDIR: a memory-only server and two agents of nnodes=2, nproc-per-node=2.
# Prints "ok" or "FAILED: why".
job() {
  local venv=$1 launcher=$2 dir=$3 cfg port srv rc1 rc2 lines
  mkdir -p "$dir"
  cfg=$(mktemp -d)  # the server's token lives here; the agents read it there
  printf '%s\n' "$HELLO" > "$dir/hello.py"
  XDG_CONFIG_HOME=$cfg "$venv/bin/rdzv-server" --memory --host 127.0.0.1 --port 0 \
    > "$dir/server.out" 2> "$dir/server.log" &
  srv=$!
  port=""
  for _ in $(seq 300); do
    port=$(sed -n 's|^rdzv-server listening on http://127.0.0.1:\([0-9]*\).*|\1|p' "$dir/server.out" 2>/dev/null | head -n 1)
    [ -n "$port" ] && break
    kill -0 "$srv" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$port" ]; then
    kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null; rm -rf "$cfg"
    echo "FAILED: the server did not start (see $dir/server.log)"; return
  fi
  local pids=()
  for node in 1 2; do
    XDG_CONFIG_HOME=$cfg OMP_NUM_THREADS=1 timeout -k 10 "$JOB_TIMEOUT" "$venv/bin/$launcher" \
      --rdzv-backend=rdzv-server --rdzv-endpoint="127.0.0.1:$port" --rdzv-id="compat-$launcher" \
      --nnodes=2 --nproc-per-node=2 --local-addr=127.0.0.1 "$dir/hello.py" > "$dir/node$node.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[0]}"; rc1=$?
  wait "${pids[1]}"; rc2=$?
  kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null; rm -rf "$cfg"
  # Two workers of a node share its output: one's line may land inside the other's.
  lines=$(cat "$dir"/node*.log | grep -o 'rank [0-3]/4 on node [01]: sum=6\.0' | sort -u | wc -l)
  if [ "$rc1" = 0 ] && [ "$rc2" = 0 ] && [ "$lines" = 4 ]; then
    echo "ok"
  else
    echo "FAILED: exit codes $rc1 $rc2, $lines of 4 rank lines (see $dir)"
  fi
}

# counts JUNIT_XML: "passed P, failed F, skipped S"
counts() {
  "$PYTHON" - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    suites = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("no report"); sys.exit()
tests = failed = skipped = 0
for suite in suites.iter("testsuite"):
    tests += int(suite.get("tests", 0))
    failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped += int(suite.get("skipped", 0))
print(f"{tests - failed - skipped} passed, {failed} failed, {skipped} skipped")
PY
}

mkdir -p "$OUT" "$BASE"
ROWS=()
STATUS=0
for version in "$@"; do
  logs="$OUT/$version"
  rm -rf "$logs"; mkdir -p "$logs"
  venv=$(mktemp -d "$BASE/torch-$version.XXXXXX")
  echo "== torch $version: venv $venv, logs $logs" >&2
  tests="not run" jobs="not run"
  if ! (install "$version" "$venv") > "$logs/install.log" 2>&1; then
    tests="FAILED: install (see $logs/install.log)"
    STATUS=1
  else
    installed=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)
    echo "   installed torch $installed; running the torch-facing tests" >&2
    (cd "$ROOT" && "$venv/bin/python" -m pytest -q -p no:cacheprovider --junitxml="$logs/junit.xml" \
       "${TORCH_TESTS[@]}") > "$logs/tests.log" 2>&1
    rc=$?
    tests=$(counts "$logs/junit.xml")
    [ "$rc" = 0 ] || { tests="$tests (pytest exit $rc)"; STATUS=1; }
    entry_points=$("$venv/bin/python" -c \
      'from torch.distributed.elastic.rendezvous import registry as r; print(int(hasattr(r, "_register_out_of_tree_handlers")))' 2>/dev/null)
    echo "   running the two-node jobs" >&2
    jobs="rdzv-torchrun $(job "$venv" rdzv-torchrun "$logs/job-rdzv-torchrun")"
    if [ "$entry_points" = 1 ]; then
      jobs="$jobs; torchrun $(job "$venv" torchrun "$logs/job-torchrun")"
    else
      jobs="$jobs; torchrun n/a (no entry points before torch 2.6)"
    fi
    case "$jobs" in *FAILED*) STATUS=1 ;; esac
    version="$version ($installed)"
  fi
  [ "${KEEP_VENVS:-0}" = 1 ] || rm -rf "$venv"
  ROWS+=("$version|$tests|$jobs")
  echo "   tests: $tests; jobs: $jobs" >&2
done

echo
echo "torch compatibility, $(date -u +%Y-%m-%d), $(uname -m), Python $("$PYTHON" -c 'import platform; print(platform.python_version())')"
printf '%s\n' "torch|torch-facing tests|two-node job" "${ROWS[@]}" | column -t -s '|' -o ' | '
exit "$STATUS"
