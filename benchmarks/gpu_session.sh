#!/usr/bin/env bash
# Everything a lent GPU machine's one call runs, in the order the device's minutes are best spent.
#
# 1. the training step's profile (where time and host waits go; about 30 s on an H100),
# 2. the working-set micro-benchmark (a few seconds),
# 3. the step's kernel-launching ops, by line (op_count.py, a few seconds),
# 4. `python -m speedswap bench --all` (gpu tests, transport, training step, feeder,
#    word2vec) within what parts 1-3 left of 570 s. The gpu tests alone, about 1010 cases,
#    took 196 s for 948 and 18 s for the other 62 in 7 workers on an H200 (2026-11-29,
#    two pytest runs): the beyond-GPU vocabulary (about
#    100 s more) does not fit beside them, and runs in a second call when the session has
#    the device time: `python3 -m speedswap bench --all --steps beyond-gpu --out $OUT/beyond`.
# Each part runs under its own `timeout`, so the results are packed before the call's
# 600 s limit: $OUT/results.tgz (every JSON and log) and $OUT/SUMMARY.md, then the
# bench log's tail is printed. With .carry/wheels (gensim, see benchmarks/README.md)
# the word2vec step also measures gensim.
#
# Usage, from the checkout's root, as the device tool's command (timeout_s 600):
#     bash benchmarks/gpu_session.sh
# Environment: OUT (required: where the results go), PYTHON (default python3),
# SPEEDSWAP_SESSION_DRY=1 (tiny sizes and `bench --all --dry-run`: what the tests run on a CPU).
set -u
: "${OUT:?set OUT to the folder the results go to}"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .carry/wheels ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/speedswap-site .carry/wheels/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/speedswap-site
fi
if [ "${SPEEDSWAP_SESSION_DRY:-0}" = 1 ]; then
    profile=(--vocab 2000 --steps 2 --batch 64 --dim 8) working=(--repeats 2) count=(--vocab 2000 --steps 2)
    bench=(--dry-run)
else
    profile=() working=(--repeats 50) count=() bench=()
fi
results=$(mktemp -d)
mkdir -p "$results/bench"
(
    cd benchmarks || exit 1
    timeout 75 "$PYTHON" profile_step.py "${profile[@]}" --out "$results" > "$results/profile_step.log" 2>&1
    echo "profile_step.py exit $?" >> "$results/profile_step.log"
    timeout 25 "$PYTHON" working_set.py "${working[@]}" --out "$results" > "$results/working_set.log" 2>&1
    echo "working_set.py exit $?" >> "$results/working_set.log"
    timeout 30 "$PYTHON" op_count.py "${count[@]}" --by-line 40 --out "$results" > "$results/op_count.log" 2>&1
    echo "op_count.py exit $?" >> "$results/op_count.log"
)
# What the parts above left of 570 s (30 s to pack and print), the last step's overrun included.
budget=$((570 - SECONDS - 10))
timeout $((budget + 10)) "$PYTHON" -m speedswap bench --all "${bench[@]}" --budget-s $budget \
    --steps gpu-tests,transport,training-step,feeder,word2vec --out "$results/bench" > "$results/bench.log" 2>&1
status=$?
tar czf "$OUT/results.tgz" -C "$results" .
cp "$results/bench/SUMMARY.md" "$OUT/" 2>/dev/null
tail -n 2 "$results/profile_step.log" "$results/working_set.log" "$results/op_count.log"
tail -c 4000 "$results/bench.log"
rm -rf "$results"
exit $status
