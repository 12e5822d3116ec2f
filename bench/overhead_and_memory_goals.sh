#!/usr/bin/env bash
# Every goal of issue 27 measured in one run, back to back, each with its own
# interleaved (paired) comparison; bench/RESULTS.md records the output.
#
#   bash bench/overhead_and_memory_goals.sh > /tmp/goals.txt
#
# Needs the Release build (cmake --preset release; targets diffcomm-sim,
# bench_sim, bench_mpi) and the Python package in build/python-venv
# (scripts/test-python makes it). About 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rel=build/release
py=${DIFFCOMM_BENCH_PYTHON:-build/python-venv/bin/python}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpirun --oversubscribe --mca btl self,vader)
# Columns of a bench_mpi / bench_sim line: the name and its counters.
counters() { grep '^BM_' | sed 's/iterations:[0-9]*\///' |
  awk '{printf "  %s", $1; for (i = 6; i <= NF; i++) printf " %s", $i; print ""}'; }
bm=(--benchmark_color=false)

echo "# issue 27 goals, $(date -u +%FT%TZ), $(git rev-parse --short HEAD), load $(cut -d' ' -f1-3 /proc/loadavg)"

echo "## 1. exchange bytes: step --ranks 16 --cp 2 --tp 4 --sp, seeds 0-4 (total vs owner_minimum)"
for seed in 0 1 2 3 4; do
  "$rel/tools/diffcomm-sim" step --ranks 16 --cp 2 --tp 4 --sp --seed "$seed" --json |
    "$py" -c "import json, sys; d = json.load(sys.stdin); b = d['bytes']
print(f\"  seed $seed: total {b['total']} owner_minimum {b['owner_minimum']} \"
      f\"padded_all_gather {b['padded_all_gather']} check passed {d['check']['passed']}\")"
done
echo "## 1. 1024 ranks (seed 0): peak RSS per rank, busiest rank's bytes received"
/usr/bin/time -v "$rel/tools/diffcomm-sim" step --ranks 1024 --cp 2 --tp 4 --sp --seed 0 --json \
  2>/tmp/issue27_time.txt | "$py" -c "import json, sys; d = json.load(sys.stdin)
print('  total', d['bytes']['total'], '= owner_minimum' if d['bytes']['total'] == d['bytes']['owner_minimum'] else '!= owner_minimum',
      '; max bytes_received', max(r['bytes_received'] for r in d['per_rank']),
      '; max exchange rows_received', max(r['rows_received'] for r in d['per_rank']))"
awk '/Maximum resident/ {printf "  peak RSS %.0f MB = %.2f MB per rank\n", $6 / 1024, $6 / 1024 / 1024}' \
  /tmp/issue27_time.txt

echo "## 2-3. diffcomm.torch vs mpi4py, np 2 (ratio; core+X = what the torch layer adds)"
"${mpi[@]}" -np 2 "$py" bench/bench_torch_mpi.py --sizes 1024,1048576,16777216 --iters 31 | sed 's/^/  /'
echo "## 2. nn:: vs dist:: (nn_vs_det) and 4. MPI vs raw (native_vs_raw, det_vs_raw), np 2"
"${mpi[@]}" -np 2 "$rel/bench/bench_mpi" "${bm[@]}" \
  --benchmark_filter='BM_(AllReduce|AllGatherSingle|AllToAllSingle)/(65536|1048576|16777216)' |
  counters
echo "## 4. MPI vs raw, np 4"
"${mpi[@]}" -np 4 "$rel/bench/bench_mpi" "${bm[@]}" \
  --benchmark_filter='BM_(AllReduce|AllGatherSingle|AllToAllSingle)/(65536|1048576|16777216)' |
  counters

echo "## 5. diffcomm.sim.run vs the C++ world, world 8"
"$py" bench/bench_sim_run.py --bench-sim "$rel/bench/bench_sim" | sed 's/^/  /'

echo "## 6. simulated world: defaults vs bare barrier at 1024 / 16384 ranks; world-8 fwd+bwd"
"$rel/bench/bench_sim" "${bm[@]}" --benchmark_filter='BM_Barrier/(1024|16384)/[0-3]/|BM_NnFwdBwd' | counters
