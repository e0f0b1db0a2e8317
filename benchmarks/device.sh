#!/usr/bin/env bash
# The device run (benchmarks/device.py's sections, then the patching sweeps on the GPU), each section under its
# own time limit, its output kept in $OUT/<section>.md. Run from the repository root on the lent machine:
#   bash benchmarks/device.sh [SECTION...]      (default: all, in this order)
# Needs .whl/ (nnsight 0.8.1 and its missing dependencies as cp312 wheels) for the sweeps.
set -u
OUT=${OUT:-/tmp/device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=3 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
declare -A LIMIT=([peak]=40 [gated_delta]=100 [forward]=130 [sweep_gptj]=300 [attribution]=90 [sweep_gpt2]=150)
sections=("$@"); [ ${#sections[@]} -eq 0 ] && sections=(peak gated_delta forward sweep_gptj attribution)
for s in "${sections[@]}"; do
  echo "== $s ($(date +%T))"
  case $s in
    sweep_gpt2) cmd=(python3 benchmarks/patching.py --family gpt2 --device cuda --repeats 3) ;;
    sweep_gptj) cmd=(python3 benchmarks/patching.py --family gptj --device cuda --repeats 2 --torch-entries 60) ;;
    *) cmd=(python3 benchmarks/device.py "$s") ;;
  esac
  timeout "${LIMIT[$s]}" "${cmd[@]}" > "$OUT/$s.md" 2> "$OUT/$s.err"; echo "rc=$? ($(date +%T))"
  cat "$OUT/$s.md"; tail -n 5 "$OUT/$s.err"
done
