"""Starts N local processes under torchrun's environment contract (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) running
``python <args>``, and exits with the first non-zero exit code, or 0.

    python python/tests/launch.py -n 4 -- -m pytest python/tests/distributed

With torch >= 2 it runs torchrun itself (``python -m torch.distributed.run
--standalone``). Debian's torch 1.13 has a torchrun that fails on Python 3.11
(its elastic agent cannot parse the redirect options), so there the
processes are started here with the same variables. A rank that fails ends
the job: the others are given ``--grace`` seconds, then terminated, as
torchrun does.
"""
import argparse
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_works() -> bool:
    import torch  # noqa: PLC0415

    return int(torch.__version__.split(".")[0]) >= 2


def launch_here(n: int, args, grace: float) -> int:
    port = str(free_port())
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, *args], env=env))
    failed_at, code = None, 0
    while any(p.poll() is None for p in procs):
        for p in procs:
            rc = p.poll()
            if rc not in (None, 0) and failed_at is None:
                failed_at, code = time.monotonic(), rc
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.05)
    for p in procs:
        if p.returncode != 0 and code == 0:
            code = p.returncode
    return code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nproc", type=int, required=True)
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds the other ranks get after one fails")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if torchrun_works():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={a.nproc}", *(["-m"] if args[:1] == ["-m"] else []),
               *(args[1:] if args[:1] == ["-m"] else args)]
        return subprocess.call(cmd)
    return launch_here(a.nproc, args, a.grace)


if __name__ == "__main__":
    sys.exit(main())
