#!/usr/bin/env bash
# The package as a user gets it: build the wheel, install it into a fresh environment outside the checkout,
# and run the first commands a user runs, from an empty directory with an empty bitrl cache (so the host C++
# helpers are built from the wheel's own sources). Usage: tests/wheel_smoke.sh [python]
set -euo pipefail
PY=${1:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/bitrl-wheel.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# Built from a copy of the tree's files (tracked, and untracked but not ignored): setuptools' build/ and
# egg-info folders land there, never stale and never in a checkout that another install may be writing to.
mkdir "$WORK/src"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -cf - -T -) | tar -xf - -C "$WORK/src"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src" >"$WORK/wheel.log" 2>&1 \
    || { cat "$WORK/wheel.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/bitrl-*.whl)
"$PY" -m venv "$WORK/env"
"$WORK/env/bin/pip" install -q --upgrade pip
"$WORK/env/bin/pip" install -q torch==2.13.0  # the CPU build; a bare torch requirement would pull CUDA
"$WORK/env/bin/pip" install -q "$WHEEL"

mkdir "$WORK/run" && cd "$WORK/run"
export BITRL_CACHE="$WORK/cache" PATH="$WORK/env/bin:$PATH"
# Nothing of the checkout may be importable from here.
python -c "import bitrl, sys; assert '$ROOT' not in bitrl.__file__, bitrl.__file__; print('bitrl from', bitrl.__file__)"

bitrl train steps=2 2>&1 | tee train.log | tail -n 3
grep -q '"steps": 2' train.log
bitrl bench --quick 2>&1 | tee bench.log | tail -n 6
grep -q '| cpu | grpo | bitrl |' bench.log
bitrl mismatch --demo 2>&1 | tee mismatch.log | tail -n 2
test -s runs/mismatch/mismatch.json
# The host C++ helpers were built from the wheel's sources, not skipped.
if grep -h "host C++ helpers unavailable" ./*.log; then
    if command -v g++ >/dev/null || command -v c++ >/dev/null; then
        echo "wheel smoke: a compiler exists but the host helpers did not build" >&2
        exit 1
    fi
fi
echo "wheel smoke: bitrl train, bench and mismatch ran from the installed wheel"
