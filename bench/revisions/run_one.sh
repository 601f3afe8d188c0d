#!/bin/bash
# usage: run_one.sh before|after N
set -u
which=$1; n=$2
dir=/tmp/bench-$which
out=/tmp/bench-results/$which-$n.json
cd $dir
echo "$(date -u +%FT%TZ) START $which-$n uptime: $(uptime)" >> /tmp/bench-results/load.log
cmd="PYTHONPATH=$dir/server:$dir/clients/python:$dir /work/main/.venv/bin/python -m bench.perf --quick --skip throughput,breakdown,history,contention,rebuild --out $out"
echo "$(date -u +%FT%TZ) CMD (cwd $dir) $cmd" >> /tmp/bench-results/load.log
start=$(date +%s)
PYTHONPATH=$dir/server:$dir/clients/python:$dir /work/main/.venv/bin/python -m bench.perf --quick --skip throughput,breakdown,history,contention,rebuild --out $out > /tmp/bench-results/$which-$n.stdout 2> /tmp/bench-results/$which-$n.stderr
rc=$?
echo "$(date -u +%FT%TZ) END $which-$n rc=$rc secs=$(( $(date +%s) - start )) uptime: $(uptime)" >> /tmp/bench-results/load.log
