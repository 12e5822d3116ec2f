#!/usr/bin/env bash
# Issue 22 item 6: `diffcomm-sim replay` of 16384 ranks x 2000 calls (goal:
# under 5 s and 2 GiB). Writes each case's synthetic dumps
# (bench/replay_synthetic.py: TP all_gather_single + world all_reduce, format
# 2) under a temporary directory, replays it RUNS times with /usr/bin/time
# (warm page cache: the dumps were just written), prints one line per run,
# then deletes the dumps (1.4 GB per case).
#
#   bench/replay_at_scale.sh [SIM] [RANKS] [ENTRIES] [RUNS]
#   SIM defaults to build/release/tools/diffcomm-sim (cmake --preset release).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sim=${1:-$here/../build/release/tools/diffcomm-sim}
ranks=${2:-16384}
entries=${3:-2000}
runs=${4:-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for case in ${CASES:-ok mismatch deadlock}; do
  python3 "$here/replay_synthetic.py" "$tmp/$case" "$ranks" "$entries" "$case"
  bytes=$(du -sb "$tmp/$case" | cut -f1)
  for run in $(seq "$runs"); do
    set +e
    /usr/bin/time -f "%e %M %U %S" -o "$tmp/time" "$sim" replay "$tmp/$case" > "$tmp/out"
    code=$?
    set -e
    read -r wall kb user sys < <(tail -1 "$tmp/time")
    echo "$case ranks=$ranks entries=$entries dump_bytes=$bytes run=$run wall_s=$wall user_s=$user sys_s=$sys" \
         "peak_rss_mib=$((kb / 1024)) exit=$code verdict=$(head -1 "$tmp/out" | cut -d' ' -f2)"
  done
  rm -rf "${tmp:?}/$case"
done
