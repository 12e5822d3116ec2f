"""``python -m diffcomm.sim <subcommand> ...`` and the ``diffcomm-sim`` console script: the
diffcomm-sim program shipped inside the package (diffcomm/bin/diffcomm-sim), run with the same
arguments, output and exit codes (docs/cli.md: 0 passed, 1 a check failed, 2 bad arguments;
replay: 3 mismatch or deadlock, 4 incomplete).
"""
import os
import sys


def program() -> str:
    """The path of the packaged diffcomm-sim program."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package, "bin", "diffcomm-sim")


def main() -> int:
    path = program()
    if not os.access(path, os.X_OK):
        print(f"diffcomm-sim: error: the program is not part of this installation ({path} is "
              "missing); reinstall diffcomm, or build it with CMake (docs/building.md)",
              file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, [path] + sys.argv[1:])  # the program's own exit code, nothing in between
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
