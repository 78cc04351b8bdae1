#!/usr/bin/env bash
# Test apmodel on one torch release, on demand (not part of .ci/run):
#
#   tools/test_torch_version.sh VERSION [PYTEST_ARGS...]     e.g. tools/test_torch_version.sh 2.11.0
#
# Creates (or reuses) the virtual environment $APMODEL_VENV_ROOT/apmodel-torch-VERSION (default
# root /tmp), installs torch==VERSION and this checkout (pip install -e '.[test]'), runs the test
# suite with PYTEST_ARGS, then plans LLaMA-3 8B on a 4x8 mesh and prints the objective. The last
# line sums it up:
#
#   torch 2.11.0+cu130: suite rc=0 (650 passed, 3 skipped in 512.3s); llama3-8b (4,8) objective_us=...
#
# Exits non-zero when the install, the suite or the plan failed. Off PyPI, torch is the default
# build (CUDA, several GB with its nvidia-* packages; it runs on CPU-only machines too).
set -uo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
version=$1
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${APMODEL_VENV_ROOT:-/tmp}/apmodel-torch-$version
log() { echo "[test_torch_version $version] $*" >&2; }

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv"
    python3 -m venv "$venv" || exit 1
fi
py=$venv/bin/python

# The release is asked for by exact version; a pip configuration may cap torch (this project's
# machines cap it at the releases on local disk), so constraint files are lifted for this one install.
log "installing torch==$version"
PIP_CONSTRAINT=/dev/null "$py" -m pip install -q "torch==$version" || { log "torch==$version did not install"; exit 1; }
log "installing $repo[test]"
# torch stays pinned here too: a capped configuration would otherwise swap it for the cap's release
PIP_CONSTRAINT=/dev/null "$py" -m pip install -q -e "$repo[test]" "torch==$version" \
    || { log "pip install -e '$repo[test]' failed"; exit 1; }
installed=$("$py" -c 'import torch; print(torch.__version__)')
log "torch $installed in $venv"
[[ $installed == "$version" || $installed == "$version"+* ]] || { log "expected torch $version, found $installed"; exit 1; }

log "running the test suite"
suite_log=$venv/suite.log
(cd "$repo" && "$py" -m pytest -q -p no:cacheprovider "$@") 2>&1 | tee "$suite_log"
suite_rc=${PIPESTATUS[0]}
summary=$(grep -E '^=*.*(passed|failed|error|skipped).* in [0-9.]+s' "$suite_log" | tail -1 | sed 's/^=* *//; s/ *=*$//')

log "planning llama3-8b on a 4x8 mesh"
plan_json=$venv/llama3-8b-4x8.json
(cd "$repo" && "$venv/bin/apmodel" plan --model llama3-8b --mesh 4x8 --json) > "$plan_json"
plan_rc=$?
objective=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["objective_us"])' "$plan_json" 2>/dev/null \
    || echo "none (plan rc=$plan_rc)")

echo "torch $installed: suite rc=$suite_rc ($summary); llama3-8b (4,8) objective_us=$objective"
[[ $suite_rc -eq 0 && $plan_rc -eq 0 ]]
