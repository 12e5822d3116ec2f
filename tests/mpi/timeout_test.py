#!/usr/bin/env python3
"""Runs tests/mpi/timeout_main.cpp under mpirun for one scenario and checks
that every rank other than the misbehaving rank 3 raised the expected error
within the time limit, with a report naming the call and the flight
recorder. Exit 0 on success.

usage: timeout_test.py SCENARIO EXPECTED_KIND MPIRUN_ARGS... PROGRAM
"""
import re
import subprocess
import sys
import time

scenario, expected = sys.argv[1], sys.argv[2]
cmd = sys.argv[3:] + [scenario]
start = time.monotonic()
try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
except subprocess.TimeoutExpired as e:
    print(f"FAIL {scenario}: mpirun still running after 120 s (a hang)")
    print((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
    sys.exit(1)
elapsed = time.monotonic() - start
out = proc.stdout + proc.stderr
results = {}
for m in re.finditer(r"^RESULT rank (\d+): (\w[\w-]*): (.*?)(?=^RESULT rank |\Z)", out, re.S | re.M):
    results[int(m.group(1))] = (m.group(2), m.group(3))
failures = []
# How each scenario must end beyond the RESULT lines: scenarios whose ranks
# return from main after a Timeout must end through the Environment's
# MPI_Abort, promptly and without a crash.
aborts = scenario.startswith("stall") or scenario == "late-start"
for r in range(3):
    if r not in results:
        failures.append(f"rank {r} printed no RESULT line")
        continue
    kind, what = results[r]
    if kind != expected:
        failures.append(f"rank {r}: expected {expected}, got {kind}: {what[:300]}")
        continue
    if scenario == "late-start":
        need = ["timed out after", "creating group 'world' (rank", "late at startup"]
    elif scenario == "check-differs":
        need = ["checked mode differs across ranks: ranks [0,1,2] check, ranks [3] do not",
                "DIFFCOMM_CHECK"]
    elif expected == "Timeout":
        # Its own deadline, or a peer's alarm (mpi::end_job) that came first;
        # rank 3 too where it waits in a call of its own (skip-barrier: its
        # all_reduce cannot complete either) and its deadline fires first.
        need = ["on group 'world'", "#", "flight recorder", ": failed ("]
        if "timed out after" not in what and not re.search(
                r"stopped waiting in .*: MPI rank [0-3] timed out in .* and is ending the job",
                what):
            failures.append(f"rank {r}: neither its deadline nor a peer's alarm: {what[:400]}")
    else:
        need = ["on group 'world'", "#", "collective mismatch", "op differs"]
    for n in need:
        if n not in what:
            failures.append(f"rank {r}: report lacks {n!r}: {what[:400]}")
if aborts:
    if "ending the MPI job with MPI_Abort (code 124)" not in out:
        failures.append("no rank ended the job with the timed-out call's MPI_Abort")
    for crash in ("Segmentation fault", "signal 11", "SIGSEGV", "Signal: 11"):
        if crash in out:
            failures.append(f"a process crashed ({crash!r})")
elif scenario == "check-differs" and proc.returncode != 0:
    failures.append(f"mpirun exited {proc.returncode}; a refused world must finalize cleanly")
if elapsed > 60:
    failures.append(f"took {elapsed:.0f} s (the deadline is seconds)")
print(out)
if failures:
    print(f"FAIL {scenario} ({elapsed:.1f} s):\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"PASS {scenario}: ranks 0-2 raised {expected} in {elapsed:.1f} s")
