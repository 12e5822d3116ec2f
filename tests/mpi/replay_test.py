#!/usr/bin/env python3
"""Closed loop of issue 22: a program whose failure is known (replay_main.cpp)
runs under mpirun with checking off and DIFFCOMM_FR_DUMP_DIR set; the dumps are
replayed by `diffcomm-sim replay --json`, whose verdict, group, call, op, ranks
and field must equal the expectation written below (the program's known
failure) and, for a mismatch, what checked mode raises for the same program.

usage: replay_test.py SCENARIO NP DIFFCOMM_SIM MPIRUN... PROGRAM
"""
import json
import os
import re
import subprocess
import sys
import tempfile

# The known failure of each program (global ranks), written by hand.
EXPECTED = {
    "dtype": dict(verdict="mismatch", group="world", call=2, op="all_reduce", ranks=[0, 2],
                  field="dtype", exit=3),
    "a2a-splits": dict(verdict="mismatch", group="{1,2,3}", call=1, op="all_to_all_single",
                       ranks=[1, 3], field="splits", exit=3),
    "hang": dict(verdict="deadlock", group="world", call=1, op="barrier", ranks=[1], field="",
                 exit=3),
    "healthy": dict(verdict="ok", group="", call=None, op="", ranks=[], field="", exit=0),
    "truncated": dict(verdict="incomplete", group="world", call=None, op="", ranks=[1],
                      field="", exit=4),
}


# Members of the failing call where not the whole world (the others raise nothing).
MEMBERS = {"a2a-splits": [1, 2, 3]}


def run_job(mpirun, np_, program, scenario, env_extra):
    env = dict(os.environ, **env_extra)
    cmd = [a if a != "4" else str(np_) for a in mpirun] + [program, scenario]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    results = {}
    for line in p.stdout.splitlines():
        m = re.match(r"RESULT rank (\d+): (.*)$", line)
        if m:
            results[int(m.group(1))] = m.group(2).split("|", 4)
    if len(results) != np_:
        sys.exit(f"FAIL: {len(results)} of {np_} ranks reported\n{p.stdout}\n{p.stderr}")
    return results


def checked_mismatch(results):
    """The CollectiveMismatch checked mode raised: (group, call, op, ranks, field)."""
    for kind, group, call, op, detail in results.values():
        if kind == "CollectiveMismatch":
            ranks = []
            for g in re.findall(r"\(global (\d+)\)", detail):
                if int(g) not in ranks:
                    ranks.append(int(g))
            field = re.search(r": ([a-z_ ()]+?) differs?$", detail).group(1)
            return dict(group=group, call=int(call), op=op, ranks=ranks, field=field)
    sys.exit(f"FAIL: checked mode raised no CollectiveMismatch: {results}")


def main():
    scenario, np_, sim = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mpirun, program = sys.argv[4:-1], sys.argv[-1]
    exp = EXPECTED[scenario]
    program_scenario = "healthy" if scenario == "truncated" else scenario
    with tempfile.TemporaryDirectory() as dumps:
        extra = {"DIFFCOMM_CHECK": "0", "DIFFCOMM_FR_DUMP_DIR": dumps}
        if scenario == "truncated":
            extra["REPLAY_SMALL_RING"] = "1"
        run_job(mpirun, np_, program, program_scenario, extra)
        files = sorted(os.listdir(dumps))
        if files != sorted(f"rank-{r}.json" for r in range(np_)):
            sys.exit(f"FAIL: dump files {files}")
        p = subprocess.run([sim, "replay", dumps, "--json"], capture_output=True, text=True)
        try:
            rep = json.loads(p.stdout)
        except json.JSONDecodeError:
            sys.exit(f"FAIL: replay printed no JSON (exit {p.returncode}): {p.stdout}{p.stderr}")
        print(json.dumps(rep, indent=1))
        got = dict(verdict=rep["verdict"], group=rep["group"], op=rep["op"], ranks=rep["ranks"],
                   field=rep["field"], exit=p.returncode)
        want = {k: v for k, v in exp.items() if k != "call"}
        if got != want:
            sys.exit(f"FAIL: replay gave {got}, expected {want}")
        if exp["call"] is not None and rep["call"] != exp["call"]:
            sys.exit(f"FAIL: replay names call {rep['call']}, expected {exp['call']}")
        if scenario == "hang":
            # Each waiting rank's line names where the program made the call
            # (the dumps carry each call's caller: issue [4/7] item 5).
            p = subprocess.run([sim, "replay", dumps], capture_output=True, text=True)
            if not re.search(r"waits in barrier #1 .* at \S*replay_main\.cpp:\d+\n", p.stdout):
                sys.exit(f"FAIL: the replay's deadlock report names no call site:\n{p.stdout}")
        if scenario == "truncated":
            # The replay must not have blamed a mismatch on a lost prefix.
            os.remove(os.path.join(dumps, "rank-2.json"))
            p = subprocess.run([sim, "replay", dumps], capture_output=True, text=True)
            if p.returncode != 2 or "rank-2.json: missing" not in p.stderr:
                sys.exit(f"FAIL: a missing rank file gave exit {p.returncode}: {p.stderr}")
    if exp["verdict"] == "mismatch":
        with tempfile.TemporaryDirectory() as dumps:
            # Checked mode, no dump on request: every member of the call must
            # have dumped by itself when it raised CollectiveMismatch.
            extra = {"DIFFCOMM_CHECK": "1", "DIFFCOMM_FR_DUMP_DIR": dumps,
                     "REPLAY_NO_REQUEST": "1"}
            checked = checked_mismatch(run_job(mpirun, np_, program, scenario, extra))
            files = sorted(os.listdir(dumps))
            want = sorted(f"rank-{r}.json" for r in MEMBERS.get(scenario, range(np_)))
            if files != want:
                sys.exit(f"FAIL: on CollectiveMismatch the funnel dumped {files}, expected {want}")
            if len(want) == np_:  # the whole world dumped: those dumps replay the same
                p = subprocess.run([sim, "replay", dumps, "--json"], capture_output=True, text=True)
                again = json.loads(p.stdout)
                again = {k: again[k] for k in ("group", "call", "op", "ranks", "field")}
                if again != checked:
                    sys.exit(f"FAIL: the funnel's dumps replay to {again}, checked mode {checked}")
        replayed = dict(group=rep["group"], call=rep["call"], op=rep["op"], ranks=rep["ranks"],
                        field=rep["field"])
        if checked != replayed:
            sys.exit(f"FAIL: checked mode raised {checked}, the replay says {replayed}")
    print(f"PASS {scenario}")


if __name__ == "__main__":
    main()
