#!/usr/bin/env python3
"""Issue [4/7] item 1, under mpirun: runs tests/mpi/every_rank_reports_main.cpp
RUNS times (rank 3 of 4 leaves early; ranks 0-2 time out in barrier #1) and
checks every run: all 3 survivors report a Timeout naming barrier #1, all 4
dumps are written (rank 3's at its exit), `diffcomm-sim replay --json` says
deadlock in barrier #1 of 'world' naming rank 3, and the job ends within the
deadline + 5 s of the survivors entering the barrier. Exit 0 when every run
passes.

usage: every_rank_reports_test.py RUNS SCENARIO DEADLINE DIFFCOMM_SIM MPIRUN... PROGRAM
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time


def check_run(scenario, deadline, sim, cmd):
    """Failures of one run (empty when it passed) and its overshoot in s."""
    with tempfile.TemporaryDirectory() as dumps:
        env = dict(os.environ, DIFFCOMM_FR_DUMP_DIR=dumps, DIFFCOMM_CHECK="0",
                   DIFFCOMM_TIMEOUT=str(deadline))
        try:
            p = subprocess.run(cmd + [scenario], env=env, capture_output=True, text=True,
                               timeout=deadline + 60)
        except subprocess.TimeoutExpired:
            return [f"mpirun still running {deadline + 60} s later (a hang)"], None
        ended = time.monotonic()
        out = p.stdout + p.stderr
        fails = []
        waits = [float(t) for t in re.findall(r"^WAIT rank \d+ ([\d.]+)$", p.stdout, re.M)]
        overshoot = None
        if len(waits) != 3:
            fails.append(f"{len(waits)} of 3 survivors reached the barrier")
        else:
            overshoot = ended - min(waits) - deadline
            if overshoot > 5.0:
                fails.append(f"the job ended {overshoot:.1f} s past the deadline (limit 5 s)")
        for r in range(3):
            if scenario == "caught":
                m = re.search(rf"^RESULT rank {r}: (\w+): (.*)$", p.stdout, re.M)
                report = m and m.group(1) == "Timeout" and m.group(2)
            else:
                m = re.search(rf"^diffcomm: uncaught Timeout: (.*\(rank {r} of 4\).*)$", p.stderr,
                              re.M)
                report = m and m.group(1)
            if not report or "barrier #1 on group 'world'" not in report:
                fails.append(f"rank {r} printed no Timeout report naming barrier #1")
        files = sorted(os.listdir(dumps))
        if files != [f"rank-{r}.json" for r in range(4)]:
            fails.append(f"dumps written: {files}")
        else:
            rep = subprocess.run([sim, "replay", dumps, "--json"], capture_output=True,
                                 text=True)
            try:
                v = json.loads(rep.stdout)
                got = (v["verdict"], v["group"], v["call"], v["op"], v["ranks"])
            except (json.JSONDecodeError, KeyError):
                got = rep.stdout + rep.stderr
            if got != ("deadlock", "world", 1, "barrier", [3]):
                fails.append(f"replay: {got}")
        if fails:
            fails.append(f"mpirun exit {p.returncode}; output:\n{out[-3000:]}")
        return fails, overshoot


def main():
    runs, scenario, deadline, sim = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
    cmd = sys.argv[5:]
    worst = 0.0
    for i in range(runs):
        fails, overshoot = check_run(scenario, deadline, sim, cmd)
        if fails:
            print(f"FAIL run {i + 1} of {runs} ({scenario}):\n  " + "\n  ".join(fails))
            sys.exit(1)
        worst = max(worst, overshoot)
    print(f"PASS {scenario}: {runs} runs, every rank reported and dumped, replay said deadlock; "
          f"the job ended at most {worst:.2f} s past the {deadline:g} s deadline")


if __name__ == "__main__":
    main()
