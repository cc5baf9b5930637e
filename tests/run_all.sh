#!/usr/bin/env bash
# `make test`: lint, the main suite, the numerics tests on torch's other CPU kernels, the transformers-5.5 +
# verl environment's tests, and the installed wheel's smoke. The second environment's install and the wheel
# smoke mostly wait on pip and the disk, so they run beside the main suite (on the 2-core CI machine that
# saves about five minutes). Every part runs; the exit status is nonzero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

"$BIN/ruff" check . || exit 1
make -s .venv-oldest/.installed >"$logs/oldest-install.log" 2>&1 &
oldest_install=$!
bash tests/wheel_smoke.sh "$BIN/python" >"$logs/wheel-smoke.log" 2>&1 &
wheel=$!

failed=()
TRITON_INTERPRET=1 "$BIN/python" -m pytest -q --durations=15 || failed+=("main suite")
make -s test-other-kernels || failed+=("test-other-kernels")

wait "$wheel" || failed+=("test-wheel")
echo "---- the installed wheel (tests/wheel_smoke.sh)"
tail -n 25 "$logs/wheel-smoke.log"
if wait "$oldest_install"; then
  make -s test-oldest || failed+=("test-oldest")
else
  tail -n 40 "$logs/oldest-install.log"
  failed+=("the transformers-5.5 environment's install")
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf 'make test: failed: %s\n' "${failed[*]}" >&2
  exit 1
fi
