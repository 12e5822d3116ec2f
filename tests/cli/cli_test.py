#!/usr/bin/env python3
"""Command-line tests of diffcomm-sim (ctest label `cli`).

Runs the built binary and asserts on exit codes, parsed JSON fields and
values. One scenario per ctest test: tests/cli/CMakeLists.txt registers
cli_<name> for every name `cli_test.py --list` prints.

  cli_test.py --exe PATH --data CSV --workdir DIR SCENARIO
  cli_test.py --list

Plain Python 3 standard library only.
"""
import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import time

# Exit codes documented by diffcomm-sim.
PASSED, FAILED, BAD_ARGS, FAULT = 0, 1, 2, 3

# The differentiable ops `check --op` must accept (issue 6 / DESIGN.md).
OPS = [
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "all_gather_v",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_v",
    "all_to_all", "all_to_all_single", "all_reduce_premul_sum", "reduce_scatter_premul_sum",
]

# Exchange mode per decoder topology (select_feature_exchange).
def expected_mode(cp, tp, sp):
    if cp > 1:
        return "parent_variable_a2a"
    if tp == 1:
        return "local"
    return "tp_variable_a2a" if sp else "tp_variable_all_gather"


ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
# check_step tolerances (forward, gradient) per dtype.
TOLERANCE = {"float64": (0.0, 1e-12), "float32": (1e-5, 1e-4),
             "bfloat16": (1e-2, 5e-2), "float16": (1e-2, 5e-2)}

TIMEOUT_S = 45  # per invocation; ctest's TIMEOUT is the outer bound


class Failure(Exception):
    pass


def expect(cond, msg):
    if not cond:
        raise Failure(msg)


class Result:
    def __init__(self, argv, rc, out, err):
        self.argv, self.rc, self.out, self.err = argv, rc, out, err

    def describe(self):
        return (f"command: {' '.join(self.argv)}\nexit code: {self.rc}\n"
                f"--- stdout (tail) ---\n{self.out[-3000:]}\n--- stderr (tail) ---\n{self.err[-3000:]}")


class Cli:
    def __init__(self, exe, data, workdir):
        self.exe, self.data, self.workdir = exe, data, workdir

    def run(self, *args, rc=None):
        argv = [self.exe] + [str(a) for a in args]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise Failure(f"{' '.join(argv)} did not finish within {TIMEOUT_S} s (a hang?)")
        r = Result(argv, p.returncode, p.stdout, p.stderr)
        if rc is not None and r.rc != rc:
            raise Failure(f"expected exit code {rc}\n{r.describe()}")
        return r

    def json(self, *args, rc=PASSED):
        """Runs with --json; stdout must be exactly one JSON object."""
        r = self.run(*args, "--json", rc=rc)
        lines = [l for l in r.out.splitlines() if l.strip()]
        expect(len(lines) == 1, f"--json must print one line of JSON\n{r.describe()}")
        try:
            j = json.loads(lines[0])
        except json.JSONDecodeError as e:
            raise Failure(f"--json output does not parse: {e}\n{r.describe()}")
        expect(isinstance(j, dict), f"--json output is not an object\n{r.describe()}")
        return j

    def path(self, name):
        os.makedirs(self.workdir, exist_ok=True)
        return os.path.join(self.workdir, name)

    def write(self, name, text):
        p = self.path(name)
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)
        return p


SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v):
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# ---------------------------------------------------------------- step checks
def validate_step_json(j, ranks, cp, tp, sp, layout="contiguous", dtype="float64", dp=None,
                       batch=None, images_per_sample=None, sp_chunks=4):
    """Every documented field, its type, and values a correct run must have."""
    ctx = json.dumps(j)[:2000]
    for key in ["mode", "mesh", "images", "tokens", "bytes", "encoder_imbalance", "sim_time_us",
                "wall_ms", "check"]:
        expect(key in j, f"missing field '{key}' in {ctx}")
    dp = dp if dp is not None else ranks // (cp * tp)
    mesh = j["mesh"]
    for key in ["ranks", "dp", "cp", "tp", "sp", "sp_chunks", "cp_layout"]:
        expect(key in mesh, f"missing field 'mesh.{key}' in {ctx}")
    expect(mesh == {"ranks": ranks, "dp": dp, "cp": cp, "tp": tp, "sp": sp, "sp_chunks": sp_chunks,
                    "cp_layout": layout},
           f"mesh {mesh} does not match ranks={ranks} dp={dp} cp={cp} tp={tp} sp={sp} "
           f"sp_chunks={sp_chunks} {layout}")
    expect(j["mode"] == expected_mode(cp, tp, sp),
           f"mode {j['mode']!r}, expected {expected_mode(cp, tp, sp)!r}")

    expect(is_int(j["images"]) and j["images"] >= 0, f"images: {j['images']!r}")
    if batch is not None and images_per_sample is not None:
        expect(j["images"] == dp * batch * images_per_sample,
               f"images {j['images']} != dp*batch*images_per_sample = {dp}*{batch}*{images_per_sample}")
    expect(is_int(j["tokens"]) and j["tokens"] > 0, f"tokens: {j['tokens']!r}")
    multiple = (2 * cp if layout == "zigzag" else cp) * (tp if sp else 1)
    expect(j["tokens"] % multiple == 0,
           f"tokens {j['tokens']} is not a multiple of the layout's {multiple} (every sample is padded)")
    if "image_tokens" in j:
        expect(0 <= j["image_tokens"] <= j["tokens"], f"image_tokens {j['image_tokens']} > tokens")

    b = j["bytes"]
    for key in ["total", "padded_all_gather", "owner_minimum"]:
        expect(key in b and is_int(b[key]) and b[key] >= 0, f"bytes.{key}: {b.get(key)!r}")
    # Row-level routing: each row crosses once to each rank owning its token.
    expect(b["total"] == b["owner_minimum"],
           f"exchange moves {b['total']} B, the owner minimum is {b['owner_minimum']} B")
    expect(b["total"] <= b["padded_all_gather"],
           f"exact exchange moves {b['total']} B, more than the pad-to-max all-gather {b['padded_all_gather']} B")
    if cp * tp == 1:
        expect(b["total"] == 0 and b["padded_all_gather"] == 0, f"one exchange rank moves nothing: {b}")

    expect(is_num(j["encoder_imbalance"]) and j["encoder_imbalance"] >= 1.0 - 1e-12,
           f"encoder_imbalance {j['encoder_imbalance']!r} < 1 (max/mean)")
    expect(is_num(j["sim_time_us"]) and j["sim_time_us"] >= 0, f"sim_time_us {j['sim_time_us']!r}")
    if ranks > 1:
        expect(j["sim_time_us"] > 0, f"a {ranks}-rank step takes simulated time, got {j['sim_time_us']}")
    expect(is_num(j["wall_ms"]) and j["wall_ms"] > 0, f"wall_ms {j['wall_ms']!r}")

    c = j["check"]
    for key in ["forward_max_abs_diff", "grad_max_rel_diff", "passed"]:
        expect(key in c, f"missing field 'check.{key}' in {ctx}")
    expect(c["passed"] is True, f"check.passed is {c['passed']!r}: {c}")
    ftol, gtol = TOLERANCE[dtype]
    expect(is_num(c["forward_max_abs_diff"]) and 0 <= c["forward_max_abs_diff"] <= ftol,
           f"check.forward_max_abs_diff {c['forward_max_abs_diff']!r} exceeds {ftol} for {dtype}")
    expect(is_num(c["grad_max_rel_diff"]) and 0 <= c["grad_max_rel_diff"] <= gtol,
           f"check.grad_max_rel_diff {c['grad_max_rel_diff']!r} exceeds {gtol} for {dtype}")

    # per_rank (beyond the documented minimum): coordinates and conservation.
    if "per_rank" in j:
        pr = j["per_rank"]
        expect(len(pr) == ranks, f"per_rank has {len(pr)} entries for {ranks} ranks")
        for r, e in enumerate(pr):
            expect(e["rank"] == r, f"per_rank[{r}].rank = {e['rank']}")
            expect(r == e["dp"] * cp * tp + e["cp"] * tp + e["tp"],
                   f"per_rank[{r}] coordinates {e} break rank = d*cp*tp + c*tp + t")
        sent = sum(e["rows_sent"] for e in pr)
        received = sum(e["rows_received"] for e in pr)
        expect(sent == received, f"rows sent {sent} != rows received {received}")
        hidden = j.get("hidden")
        if hidden is not None:
            expect(b["total"] == sent * hidden * ELEMENT_BYTES[dtype],
                   f"bytes.total {b['total']} != rows sent {sent} x hidden {hidden} x {ELEMENT_BYTES[dtype]} B")


def step_case(cli, ranks, cp=1, tp=1, sp=False, layout="contiguous", extra=(), dtype="float64", **kw):
    args = ["step", "--ranks", ranks, "--cp", cp, "--tp", tp, "--cp-layout", layout, "--dtype", dtype]
    if sp:
        args.append("--sp")
    args += list(extra)
    j = cli.json(*args)
    try:
        validate_step_json(j, ranks, cp, tp, sp, layout, dtype, **kw)
    except Failure as e:
        raise Failure(f"{' '.join(map(str, args))} --json: {e}")
    return j


@scenario
def help_output(cli):
    r = cli.run("--help", rc=PASSED)
    for sub in ["step", "check", "sweep", "tokens"]:
        expect(re.search(rf"^\s+{sub}\b", r.out, re.M), f"--help does not list '{sub}'\n{r.describe()}")
    r = cli.run("step", "--help", rc=PASSED)
    for opt in ["--ranks", "--dp", "--cp", "--tp", "--sp", "--sp-chunks", "--cp-layout", "--encoder-buckets",
                "--encoder-cp", "--batch", "--images-per-sample", "--hidden", "--dtype", "--seed",
                "--images", "--json", "--fault", "--trace"]:
        expect(re.search(rf"{re.escape(opt)}\b", r.out), f"step --help does not document {opt}")


@scenario
def step_local(cli):
    r = cli.run("step", rc=PASSED)
    expect("mode local" in r.out and "PASSED" in r.out, f"default step report\n{r.describe()}")
    step_case(cli, 1)


@scenario
def step_text_report(cli):
    r = cli.run("step", "--ranks", 4, "--cp", 2, "--tp", 2, "--sp", rc=PASSED)
    out = r.out
    for pat in [r"4 ranks, mesh dp=1 cp=2 tp=2 sp=on cp_layout=contiguous, mode parent_variable_a2a",
                r"encoder: 4 buckets x encoder_cp 1, imbalance \d+\.\d+",
                r"exchange: .* moved across ranks vs .* pad-to-max all-gather",
                r"simulated time: [0-9.]+ us",
                r"forward max \|diff\| = 0 .*-> PASSED",
                r"wall time: [0-9.]+ ms"]:
        expect(re.search(pat, out), f"report lacks /{pat}/\n{r.describe()}")
    rows = re.findall(r"^\s+(\d+)\s+0\s+[01]\s+[01](\s+\d+){5}\s*$", out, re.M)
    expect(len(rows) == 4, f"expected a table row per rank (4), found {len(rows)}\n{r.describe()}")
    expect(r.err == "", f"a passing step writes nothing to stderr\n{r.describe()}")


@scenario
def step_tp_modes(cli):
    step_case(cli, 2, tp=2)                                   # tp_variable_all_gather
    step_case(cli, 4, tp=4, sp=True)                          # tp_variable_a2a
    step_case(cli, 4, tp=2, extra=["--dp", 2], dp=2)          # two replicas
    step_case(cli, 4, tp=4, sp=True, extra=["--encoder-buckets", 2, "--encoder-cp", 2])


@scenario
def step_cp_modes(cli):
    step_case(cli, 2, cp=2)
    step_case(cli, 4, cp=2, tp=2, sp=True, layout="zigzag")
    step_case(cli, 8, cp=4, tp=2, layout="zigzag")
    step_case(cli, 6, cp=3, tp=2, sp=True, layout="zigzag", extra=["--hidden", 8])
    step_case(cli, 4, cp=2, tp=2, extra=["--encoder-buckets", 2, "--encoder-cp", 2])


@scenario
def step_16_ranks(cli):
    # The README's demo: 16 ranks, cp 2, tp 4, sequence parallel, COCO sizes.
    r = cli.run("step", "--ranks", 16, "--cp", 2, "--tp", 4, "--sp", rc=PASSED)
    expect("16 ranks, mesh dp=2 cp=2 tp=4 sp=on" in r.out and "PASSED" in r.out, r.describe())
    step_case(cli, 16, cp=2, tp=4, sp=True)


@scenario
def step_16_ranks_zigzag(cli):
    step_case(cli, 16, cp=2, tp=4, sp=True, layout="zigzag")


@scenario
def step_sp_chunks(cli):
    # --sp-chunks K: K all-gathers and K reduce-scatters of each SP shard per
    # step (shards of hundreds of rows here), the same bytes, the same check.
    one = step_case(cli, 16, cp=2, tp=4, sp=True, sp_chunks=1, extra=["--sp-chunks", 1])
    three = step_case(cli, 16, cp=2, tp=4, sp=True, sp_chunks=3, extra=["--sp-chunks", 3])
    expect(one["bytes"] == three["bytes"], f"{one['bytes']} vs {three['bytes']}")
    for a, b in zip(one["per_rank"], three["per_rank"]):
        expect(b["calls"] - a["calls"] == 4 and b["bytes_sent"] == a["bytes_sent"],
               f"sp_chunks 1 vs 3: {a} vs {b}")
    # A failing sweep's reproduce line carries a K other than the default.
    r = cli.run("sweep", "--seeds", "0..0", "--ranks", 4, "--cp", 2, "--tp", 2, "--sp",
                "--sp-chunks", 2, "--receiver-grad", "replicated-over-tp", rc=FAILED)
    repro = re.findall(r"^  reproduce: (diffcomm-sim step .*)$", r.out, re.M)
    expect(len(repro) == 1 and "--sp-chunks 2" in repro[0], r.describe())


@scenario
def step_json_fields(cli):
    j = step_case(cli, 8, cp=2, tp=2, sp=True, dp=2, batch=3, images_per_sample=2,
                  extra=["--dp", 2, "--batch", 3, "--images-per-sample", 2, "--hidden", 16,
                         "--seed", 5, "--images", cli.data])
    expect(j.get("hidden") == 16 and j.get("seed") == 5, f"hidden/seed not echoed: {j}")
    expect(j["bytes"]["total"] > 0, f"a 2x2 exchange moves bytes: {j['bytes']}")


@scenario
def step_dtypes(cli):
    base = ["--hidden", 16, "--seed", 3]
    j64 = step_case(cli, 4, cp=2, tp=2, sp=True, extra=base)
    for dtype in ["float32", "bfloat16", "float16"]:
        j = step_case(cli, 4, cp=2, tp=2, sp=True, extra=base, dtype=dtype)
        # Same plan, narrower rows: bytes scale exactly with the element size.
        expect(j["bytes"]["total"] * ELEMENT_BYTES["float64"] ==
               j64["bytes"]["total"] * ELEMENT_BYTES[dtype],
               f"{dtype} moves {j['bytes']['total']} B vs {j64['bytes']['total']} B in float64")
        expect(j["tokens"] == j64["tokens"] and j["images"] == j64["images"], "dtype changed the batch")


@scenario
def step_seed_determinism(cli):
    args = ["step", "--ranks", 4, "--cp", 2, "--tp", 2, "--sp", "--seed", 11]
    a, b = cli.json(*args), cli.json(*args)
    for j in (a, b):
        j.pop("wall_ms")
    expect(a == b, "the same seed gave different reports")
    c = cli.json("step", "--ranks", 4, "--cp", 2, "--tp", 2, "--sp", "--seed", 12)
    c.pop("wall_ms")
    expect(c != a, "seeds 11 and 12 gave identical reports")


BAD_STEP_ARGS = [
    # (arguments, text the message must contain)
    (["--tp", 3, "--ranks", 8], "--ranks"),
    (["--ranks", 2, "--dp", 3], "--ranks"),
    (["--ranks", 4, "--tp", 4, "--encoder-buckets", 3], "--encoder-buckets"),
    (["--ranks", 4, "--tp", 4, "--encoder-cp", 3], "--encoder-cp"),
    (["--ranks", 4, "--tp", 4, "--ffn", 30], "--ffn"),
    (["--fault", "garbage"], "--fault"),
    (["--fault", "rank:1"], "--fault"),
    (["--ranks", 4, "--tp", 4, "--fault", "rank:4:at:1"], "--fault"),
    (["--ranks", 4, "--tp", 4, "--fault", "rank:1:at:0"], "--fault"),
    (["--fault", "rank:99999999999:at:1"], "--fault"),
    (["--dtype", "int32"], "--dtype"),
    (["--dtype", "float8"], "--dtype"),
    (["--cp-layout", "diagonal"], "--cp-layout"),
    (["--ranks", 0], "--ranks"),
    (["--tp", 0], "--tp"),
    (["--hidden", 0], "--hidden"),
    (["--sp-chunks", 0], "--sp-chunks"),
    (["--sp-chunks", 65537], "--sp-chunks"),
    (["--batch", -1], "--batch"),
    (["--seed", -1], "--seed"),
    (["--seed", "abc"], "--seed"),
    (["--images", "/nonexistent/diffcomm/sizes.csv"], "--images"),
    (["--no-such-option"], "--no-such-option"),
]


def expect_bad(cli, args, needle):
    r = cli.run(*args, rc=BAD_ARGS)
    expect(needle in r.err, f"the message does not name {needle}\n{r.describe()}")
    expect(r.out.strip() == "", f"a bad argument prints no report\n{r.describe()}")


@scenario
def step_bad_args(cli):
    for args, needle in BAD_STEP_ARGS:
        expect_bad(cli, ["step"] + args, needle)


@scenario
def step_bad_images(cli):
    empty = cli.write("empty.csv", "image_id,width,height\n")
    nocol = cli.write("nocol.csv", "image_id,width\n1,640\n")
    bad = cli.write("bad.csv", "image_id,width,height\n1,640,480\n2,abc,480\n")
    zero = cli.write("zero.csv", "image_id,width,height\n1,0,480\n")
    wide = cli.write("wide.csv", "image_id,width,height\n1,20000,20\n")  # aspect ratio > 200
    for path in [empty, nocol, bad, zero, wide, cli.workdir]:
        expect_bad(cli, ["step", "--images", path], "--images")
    r = cli.run("step", "--images", bad, rc=BAD_ARGS)
    expect("line 3" in r.err, f"a malformed row is reported with its line number\n{r.describe()}")


@scenario
def replay_seed_and_seeds_exclude_each_other(cli):
    # Both given, one was silently ignored (found by a hostile-input run).
    expect_bad(cli, ["replay", cli.workdir, "--seeds", "1..2", "--seed", 3], "--seed")


@scenario
def bad_subcommand(cli):
    for args in [[], ["frobnicate"], ["step", "extra_positional"]]:
        r = cli.run(*args, rc=BAD_ARGS)
        expect(r.err.strip() != "", f"exit 2 needs a message\n{r.describe()}")


def validate_fault_json(j, rank, at, ranks):
    expect(j["check"]["passed"] is False, f"a faulted run cannot pass: {j['check']}")
    f = j.get("fault")
    expect(isinstance(f, dict), f"no 'fault' object: {j}")
    expect(f.get("rank") == rank and f.get("at_call") == at and f.get("triggered") is True,
           f"fault {f} does not match rank {rank} at call {at}")
    call = f.get("call", "")
    expect(f"rank {rank}" in call and f"#{at}" in call, f"fault.call {call!r} names neither rank nor call")
    expect(any(re.search(rf"\b{op}\b", call) for op in OPS + ["new_group", "barrier", "send", "recv"]),
           f"fault.call {call!r} does not name the collective")
    expect(j["mesh"]["ranks"] == ranks, f"mesh {j['mesh']}")


@scenario
def step_fault(cli):
    # Rank 1 fails at its 4th call (a collective of the TP exchange).
    args = ["step", "--ranks", 4, "--tp", 4, "--fault", "rank:1:at:4"]
    r = cli.run(*args, rc=FAULT)
    m = re.search(r"injected fault: (.*)", r.out)
    expect(m, f"the report does not show the injected fault\n{r.describe()}")
    expect("rank 1" in m.group(1) and "call #4" in m.group(1),
           f"the fault line must name rank 1 and call #4\n{r.describe()}")
    expect(re.search(r"none hung", r.out), f"the report says whether ranks hung\n{r.describe()}")
    validate_fault_json(cli.json(*args, rc=FAULT), 1, 4, 4)


@scenario
def step_fault_parent_group(cli):
    for at in [1, 5]:
        j = cli.json("step", "--ranks", 8, "--cp", 2, "--tp", 4, "--sp", "--fault", f"rank:6:at:{at}",
                     rc=FAULT)
        validate_fault_json(j, 6, at, 8)


@scenario
def step_fault_not_triggered(cli):
    # K beyond the rank's calls: the run completes, passes and says so.
    r = cli.run("step", "--ranks", 2, "--tp", 2, "--fault", "rank:1:at:100000", rc=PASSED)
    expect("never triggered" in r.out and "PASSED" in r.out, r.describe())
    j = cli.json("step", "--ranks", 2, "--tp", 2, "--fault", "rank:1:at:100000", rc=PASSED)
    expect(j["fault"]["triggered"] is False and j["check"]["passed"] is True, f"{j}")


def validate_trace(path, ranks):
    expect(os.path.isfile(path), f"--trace did not write {path}")
    with open(path, encoding="utf-8") as f:
        try:
            t = json.load(f)
        except json.JSONDecodeError as e:
            raise Failure(f"{path} is not valid JSON: {e}")
    expect(isinstance(t, dict) and isinstance(t.get("traceEvents"), list),
           f"{path} has no traceEvents list")
    events = t["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X"]
    expect(complete, f"{path} has no complete ('X') events")
    for e in events:
        for key in ["name", "ph", "pid", "tid"]:
            expect(key in e, f"trace event without '{key}': {e}")
    for e in complete:
        expect(is_num(e.get("ts")) and e["ts"] >= 0 and is_num(e.get("dur")) and e["dur"] >= 0,
               f"complete event needs ts and dur >= 0: {e}")
    return t, complete


@scenario
def step_trace(cli):
    path = cli.path("step_trace.json")
    if os.path.exists(path):
        os.remove(path)
    r = cli.run("step", "--ranks", 4, "--cp", 2, "--tp", 2, "--sp", "--trace", path, rc=PASSED)
    expect(path in r.out, f"the report names the trace file\n{r.describe()}")
    _, complete = validate_trace(path, 4)
    expect({e["tid"] for e in complete} == {0, 1, 2, 3}, "every rank has a track of calls")
    names = {e["name"] for e in complete}
    expect(any("all_to_all" in n for n in names), f"the parent exchange is an all_to_all: {names}")


@scenario
def step_trace_with_fault(cli):
    path = cli.path("fault_trace.json")
    if os.path.exists(path):
        os.remove(path)
    cli.run("step", "--ranks", 4, "--tp", 4, "--fault", "rank:1:at:5", "--trace", path, rc=FAULT)
    validate_trace(path, 4)


@scenario
def empty_path_options(cli):
    """--images "" (and --trace "") is a given but empty path: exit 2, never the default."""
    def bad(args, needle, why="is empty"):
        r = cli.run(*args, rc=BAD_ARGS)
        lines = r.err.strip().splitlines()
        expect(len(lines) == 1 and needle in lines[0] and why in lines[0],
               f"one line naming {needle} ({why}) expected\n{r.describe()}")
        expect(r.out.strip() == "", f"a bad argument prints no report\n{r.describe()}")
    for sub in [["step"], ["sweep", "--seeds", "0..0"], ["tokens"]]:
        bad(sub + ["--images", ""], "--images")
        bad(sub + ["--images="], "--images", "missing")  # CLI11: no value at all
    bad(["step", "--trace", ""], "--trace")


# A valid step that takes seconds (about 7 s in a Debug build): a bad output
# path must be refused before it runs, not after.
SLOW_STEP = ["step", "--ranks", 2048, "--cp", 4, "--tp", 4, "--batch", 2, "--hidden", 8, "--ffn", 8]


@scenario
def step_trace_bad_path_fails_fast(cli):
    missing = os.path.join(cli.workdir, "no_such_dir", "t.json")
    for path in [missing, cli.path("")]:  # a missing directory; a directory
        t0 = time.monotonic()
        r = cli.run(*SLOW_STEP, "--trace", path, rc=BAD_ARGS)
        elapsed = time.monotonic() - t0
        expect(f"--trace '{path}'" in r.err and len(r.err.strip().splitlines()) == 1,
               f"one line naming --trace and the path expected\n{r.describe()}")
        expect(r.out.strip() == "", f"the step ran before the path was checked\n{r.describe()}")
        expect(elapsed < 2.0, f"refused after {elapsed:.1f} s: the step ran first\n{r.describe()}")
    # An existing file is rewritten, not appended to; a refused step leaves no
    # empty trace file behind.
    old = cli.write("old_trace.json", "not a trace\n")
    cli.run("step", "--ranks", 2, "--tp", 2, "--trace", old, rc=PASSED)
    validate_trace(old, 2)
    fresh = cli.path("refused_trace.json")
    if os.path.exists(fresh):
        os.remove(fresh)
    bad_csv = cli.write("bad_sizes.csv", "image_id,width,height\n1,640,x\n")
    cli.run("step", "--images", bad_csv, "--trace", fresh, rc=BAD_ARGS)
    expect(not os.path.exists(fresh), f"a refused step left {fresh} behind")


# ---------------------------------------------------------------------- check
def check_op(cli, op):
    nontrivial = 0
    for ranks, seed in [(1, 0), (2, 1), (3, 2), (5, 3), (5, 6), (8, 4), (7, 9), (4, 10)]:
        j = cli.json("check", "--op", op, "--ranks", ranks, "--seed", seed)
        for key in ["op", "ranks", "seed", "lhs", "rhs", "rel_err", "passed"]:
            expect(key in j, f"check --json lacks '{key}': {j}")
        expect(j["op"] == op and j["ranks"] == ranks and j["seed"] == seed, f"echoed fields: {j}")
        expect(j["passed"] is True, f"adjoint identity failed: {j}")
        lhs, rhs, err = j["lhs"], j["rhs"], j["rel_err"]
        expect(is_num(lhs) and is_num(rhs) and is_num(err) and err >= 0, f"values: {j}")
        tol = j.get("tolerance", 1e-12)
        expect(err <= tol, f"rel_err {err} > tolerance {tol}: {j}")
        expect(abs(lhs - rhs) <= err * max(abs(lhs), abs(rhs)) * (1 + 1e-9) + 1e-300,
               f"rel_err {err} disagrees with lhs {lhs} / rhs {rhs}")
        group = j.get("group", [])
        expect(len(set(group)) == len(group) and all(0 <= g < ranks for g in group),
               f"group {group} is not a set of ranks of a {ranks}-rank world")
        if lhs != 0 and len(group) >= 2:
            nontrivial += 1
    # An identity 0 == 0 checks nothing: demand real multi-rank cases.
    expect(nontrivial >= 3, f"{op}: only {nontrivial} of 8 cases had a multi-rank group and lhs != 0")


def make_check_scenario(op):
    def run(cli):
        check_op(cli, op)
    run.__name__ = f"check_{op}"
    return run


for _op in OPS:
    scenario(make_check_scenario(_op))


@scenario
def check_text_and_dtypes(cli):
    r = cli.run("check", "--op", "all_gather_v", "--ranks", 5, "--seed", 6, rc=PASSED)
    for pat in [r"check all_gather_v on 5 ranks, seed 6", r"sum <A x, y>\s+= -?[0-9.e+-]+",
                r"sum <x, A\^T y> = -?[0-9.e+-]+", r"relative error = .*-> PASSED"]:
        expect(re.search(pat, r.out), f"check report lacks /{pat}/\n{r.describe()}")
    for dtype in ["float32", "bfloat16", "float16"]:
        for op in ["all_reduce", "reduce_scatter_v", "all_to_all_single"]:
            j = cli.json("check", "--op", op, "--ranks", 4, "--seed", 2, "--dtype", dtype)
            expect(j["passed"] is True and j["rel_err"] <= j["tolerance"], f"{dtype} {op}: {j}")


@scenario
def check_bad_args(cli):
    r = cli.run("check", "--op", "bogus", "--ranks", 4, "--seed", 1, rc=BAD_ARGS)
    expect("--op" in r.err, r.describe())
    # The message lists the accepted ops: exactly the documented ones.
    listed = re.search(r"\{([^}]*)\}", r.err)
    expect(listed and set(listed.group(1).split(",")) == set(OPS),
           f"accepted ops differ from the documented list\n{r.describe()}")
    for args, needle in [(["--op", "all_reduce", "--ranks", 4], "--seed"),
                         (["--op", "all_reduce", "--seed", 1], "--ranks"),
                         (["--ranks", 4, "--seed", 1], "--op"),
                         (["--op", "all_reduce", "--ranks", 0, "--seed", 1], "--ranks"),
                         (["--op", "all_reduce", "--ranks", 4, "--seed", -3], "--seed"),
                         (["--op", "all_reduce", "--ranks", 4, "--seed", 1, "--dtype", "int64"],
                          "--dtype")]:
        expect_bad(cli, ["check"] + args, needle)


# ---------------------------------------------------------------------- sweep
@scenario
def sweep(cli):
    r = cli.run("sweep", "--seeds", "0..3", "--ranks", 4, "--cp", 2, "--tp", 2, "--sp", rc=PASSED)
    expect(re.search(r"^sweep: 4 seeds, 4 passed, 0 failed$", r.out, re.M),
           f"sweep summary\n{r.describe()}")
    expect("FAILED" not in r.out, r.describe())
    expect("\r" not in r.out, f"no progress bar when stdout is not a terminal\n{r.describe()}")
    r = cli.run("sweep", "--seeds", "7..7", rc=PASSED)
    expect("sweep: 1 seeds, 1 passed, 0 failed" in r.out, r.describe())


@scenario
def step_check_fails_exit_1(cli):
    # Forcing the wrong receiver-gradient convention on TP replicas (tp 4, no
    # SP) sums tp equal copies: the encoder gradient is 4x the reference, the
    # check fails, exit 1. The forward (routing) is still exact.
    j = cli.json("step", "--ranks", 4, "--tp", 4, "--receiver-grad", "partial", rc=FAILED)
    expect(j["check"]["passed"] is False, f"check must fail: {j['check']}")
    expect(j["check"]["forward_max_abs_diff"] == 0.0, f"forward stays exact: {j['check']}")
    expect(abs(j["check"]["grad_max_rel_diff"] - 3.0) < 1e-9,
           f"gradient is tp = 4 times the reference (rel diff 3): {j['check']}")
    r = cli.run("step", "--ranks", 4, "--tp", 4, "--receiver-grad", "partial", rc=FAILED)
    expect("FAILED" in r.out, r.describe())
    # The same forced convention where it is the right one (SP) passes.
    j = cli.json("step", "--ranks", 4, "--tp", 4, "--sp", "--receiver-grad", "partial", rc=PASSED)
    expect(j["check"]["passed"] is True, f"{j['check']}")


@scenario
def step_out_of_fiber_stacks_names_the_cause(cli):
    """Issue [4/7] item 4: a 16384-rank step under a 1 GB address-space limit
    cannot allocate its fiber stacks; the report names that, with exit 1 (it
    said "World::stats: rank 0 out of range (run() first?)", exit 2). Not
    under AddressSanitizer, whose shadow memory needs the address space."""
    if "ASAN_OPTIONS" in os.environ:
        print("skipped: an address-space limit cannot apply under AddressSanitizer")
        return
    import resource  # noqa: PLC0415

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    argv = [cli.exe, "step", "--ranks", "16384", "--batch", "1", "--images-per-sample", "1",
            "--memory-limit", "100"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                       stdin=subprocess.DEVNULL, preexec_fn=limit)
    r = Result(argv, p.returncode, p.stdout, p.stderr)
    expect(r.rc == FAILED, f"expected exit {FAILED}\n{r.describe()}")
    expect("cannot allocate the fiber stack of rank" in r.out + r.err, r.describe())
    expect("out of range" not in r.out + r.err, r.describe())


@scenario
def step_out_of_memory_while_ranks_are_set_up_is_reported(cli):
    """Issue [4/7] item 4: under an address-space limit just above what the
    1024 fiber stacks take (256 MiB), ranks run out of memory while they are
    set up (backend, flight recorder, world group) or in their step. Every
    limit must end in a report and exit 1; a setup failure aborted the process
    (std::terminate, SIGABRT) before. The sweep crosses the limits where setup
    fails (275-310 MB on the development machine), in 3 MB steps (a step of
    10 missed 312 MB, where waking a fiber allocated and std::terminate
    followed). Not under AddressSanitizer (its shadow memory needs the
    address space)."""
    if "ASAN_OPTIONS" in os.environ:
        print("skipped: an address-space limit cannot apply under AddressSanitizer")
        return
    import resource  # noqa: PLC0415

    argv = [cli.exe, "step", "--ranks", "1024", "--batch", "1", "--images-per-sample", "1",
            "--memory-limit", "100"]
    setups = 0
    for mb in range(262, 340, 3):
        def limit(mb=mb):
            resource.setrlimit(resource.RLIMIT_AS, (mb << 20, mb << 20))

        p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                           stdin=subprocess.DEVNULL, preexec_fn=limit)
        r = Result(argv, p.returncode, p.stdout, p.stderr)
        expect(r.rc == FAILED and "run ended: " in r.out + r.err,
               f"under a {mb} MiB limit: expected exit {FAILED} with a report\n{r.describe()}")
        setups += "could not set up the rank before its function ran" in r.out + r.err
    if setups == 0:
        print("note: no limit of the sweep failed during rank setup on this machine")


@scenario
def step_equivalence_names_the_factor(cli):
    # The forced Partial convention on TP replicas is tp x the reference (see
    # step_check_fails_exit_1): --equivalence names the factor and the mesh dim.
    args = ["step", "--ranks", 8, "--dp", 2, "--tp", 4, "--receiver-grad", "partial",
            "--equivalence"]
    r = cli.run(*args, rc=FAILED)
    expect("encoder.w: grad = 4.000 x reference = tp on mesh {dp: 2, cp: 1, tp: 4}" in r.out,
           r.describe())
    expect("-> FAILED" in r.out, r.describe())
    eq = cli.json(*args, rc=FAILED)["equivalence"]
    expect(eq["ok"] is False and eq["mesh"] == {"dp": 2, "cp": 1, "tp": 4}, f"{eq}")
    params = {q["name"]: q for q in eq["params"]}
    p = params["encoder.w"]
    expect(p["placement"] == "Replicate()" and p["ok"] is False, f"{p}")
    # The decoder input's shards (the forward) are judged too, and match.
    d = params["decoder.input"]
    expect(d["placement"] == "[Shard(0, dp), Partial(cp)]" and d["ok"], f"{d}")
    expect(abs(p["factor"] - 4.0) < 1e-9 and p["factor_fits"] and p["expressions"] == ["tp"],
           f"{p}")
    expect(abs(p["max_rel_error"] - 3.0) < 1e-9 and p["divergent_ranks"] == [], f"{p}")
    # float32: the factor is matched within the dtype's gradient tolerance (1e-4).
    r = cli.run("step", "--ranks", 4, "--tp", 4, "--dtype", "float32", "--receiver-grad",
                "partial", "--equivalence", rc=FAILED)
    expect("encoder.w: grad = 4.000 x reference = tp on mesh {dp: 1, cp: 1, tp: 4}" in r.out,
           r.describe())
    # The mesh's own convention passes; without --equivalence there is no object.
    eq = cli.json("step", "--ranks", 8, "--dp", 2, "--tp", 4, "--equivalence", rc=PASSED)
    eq = eq["equivalence"]
    expect(eq["ok"] is True and all(p["factor"] is None for p in eq["params"]), f"{eq}")
    expect(all(p["max_rel_error"] <= 1e-12 for p in eq["params"]), f"{eq}")
    # CP (both layouts) and TP with SP: the decoder input's shards reassemble.
    for layout in ("contiguous", "zigzag"):
        eq = cli.json("step", "--ranks", 8, "--cp", 2, "--tp", 2, "--sp", "--cp-layout", layout,
                      "--equivalence", rc=PASSED)["equivalence"]
        d = {q["name"]: q for q in eq["params"]}["decoder.input"]
        expect(eq["ok"] and d["placement"] == "[Shard(0, dp), Partial(cp), Partial(tp)]", f"{eq}")
    expect("equivalence" not in cli.json("step", "--ranks", 2, "--tp", 2, rc=PASSED),
           "the equivalence object only with --equivalence")


@scenario
def sweep_failure_reproduces(cli):
    r = cli.run("sweep", "--seeds", "5..6", "--tp", 2, "--receiver-grad", "partial", rc=FAILED)
    expect(re.search(r"^sweep: 2 seeds, 0 passed, 2 failed$", r.out, re.M), r.describe())
    repro = re.findall(r"^  reproduce: (diffcomm-sim step .*)$", r.out, re.M)
    expect(len(repro) == 2 and "--seed 5" in repro[0] and "--seed 6" in repro[1], r.describe())
    # The printed command line reproduces the failure exactly.
    args = repro[0].split()[1:]
    again = cli.run(*args, rc=FAILED)
    expect("FAILED" in again.out, again.describe())


@scenario
def sweep_bad_args(cli):
    for args, needle in [(["--seeds", "3..1"], "--seeds"), (["--seeds", "x"], "--seeds"),
                         (["--seeds", "0..99999999999999999999999"], "--seeds"),
                         ([], "--seeds"),
                         (["--seeds", "0..1", "--tp", 3, "--ranks", 4], "--ranks"),
                         (["--seeds", "0..1", "--dtype", "int8"], "--dtype")]:
        expect_bad(cli, ["sweep"] + args, needle)


# --------------------------------------------------------------------- tokens
def qwen2vl_tokens(height, width, factor=28, min_pixels=56 * 56, max_pixels=12845056):
    """transformers' Qwen2VLImageProcessor smart_resize, then (H/28) * (W/28)."""
    h = max(factor, round(height / factor) * factor)  # Python round: half to even
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)  # the clamp (issue 13)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return (h // factor) * (w // factor)


def parse_tokens(r):
    lines = r.out.splitlines()
    expect(lines and lines[0] == "image_id,tokens", f"first line must be the header\n{r.describe()}")
    rows = []
    for n, line in enumerate(lines[1:], start=2):
        m = re.fullmatch(r"(-?\d+),(\d+)", line)
        expect(m, f"line {n} is not image_id,tokens: {line!r}")
        rows.append((int(m.group(1)), int(m.group(2))))
    return rows


@scenario
def tokens_coco(cli):
    r = cli.run("tokens", "--images", cli.data, rc=PASSED)
    rows = parse_tokens(r)
    expect(len(rows) == 5000, f"expected 5000 COCO val2017 rows, got {len(rows)}")
    # By hand (28 px factor, half-to-even rounding):
    #   139: 640x426 -> h round(15.21)=15, w round(22.86)=23 -> 345
    #   285: 586x640 -> h 23, w round(20.93)=21 -> 483
    #   632: 640x483 -> h round(17.25)=17, w 23 -> 391
    #   724: 375x500 -> h round(17.86)=18, w round(13.39)=13 -> 234
    expect(rows[:4] == [(139, 345), (285, 483), (632, 391), (724, 234)], f"first rows {rows[:4]}")
    with open(cli.data, newline="", encoding="utf-8") as f:
        sizes = [(int(d["image_id"]), int(d["width"]), int(d["height"])) for d in csv.DictReader(f)]
    expect([i for i, _ in rows] == [i for i, _, _ in sizes], "image ids differ from the CSV's order")
    for (image_id, got), (_, w, h) in zip(rows, sizes):
        want = qwen2vl_tokens(h, w)
        expect(got == want, f"image {image_id} ({w}x{h}): {got} tokens, the Qwen2-VL rule gives {want}")
    # Without --images the shipped COCO file is the default.
    expect(cli.run("tokens", rc=PASSED).out == r.out, "default tokens output differs from --images COCO")
    expect(cli.run("tokens", "--model", "qwen2vl", "--images", cli.data, rc=PASSED).out == r.out,
           "--model qwen2vl differs from the default model")


@scenario
def tokens_edge_cases(cli):
    # Reordered and extra columns; hand-computed values.
    path = cli.write("edge.csv", "height,note,image_id,width\n"
                     "426,a,139,640\n"       # 15 x 23 = 345
                     "280,b,7,70\n"          # 70/28 = 2.5 -> 2 (half to even): 10 x 2 = 20
                     "280,c,8,42\n"          # 42/28 = 1.5 -> 2: 10 x 2 = 20
                     "30,d,9,20\n"           # below min_pixels: 3 x 2 = 6
                     "8000,e,10,10000\n"     # above max_pixels: 114 x 143 = 16302
                     "28,f,11,28\n")         # 1 x 1 -> min_pixels: 2 x 2 = 4
    rows = parse_tokens(cli.run("tokens", "--images", path, rc=PASSED))
    expected = [(139, 345), (7, 20), (8, 20), (9, 6), (10, 16302), (11, 4)]
    expect(rows == expected, f"tokens {rows}, expected {expected}")
    for (image_id, got), (h, w) in zip(rows, [(426, 640), (280, 70), (280, 42), (30, 20),
                                             (8000, 10000), (28, 28)]):
        expect(got == qwen2vl_tokens(h, w), f"image {image_id}: reference rule disagrees")
    empty = cli.write("header_only.csv", "image_id,width,height\n")
    expect(parse_tokens(cli.run("tokens", "--images", empty, rc=PASSED)) == [], "no images, no rows")


@scenario
def tokens_bad_args(cli):
    nocol = cli.write("nocol.csv", "image_id,height\n1,480\n")
    bad = cli.write("bad.csv", "image_id,width,height\n1,640,x\n")
    for path in ["/nonexistent/diffcomm/sizes.csv", nocol, bad]:
        expect_bad(cli, ["tokens", "--images", path], "--images")
    expect_bad(cli, ["tokens", "--model", "llava"], "--model")


@scenario
def tokens_models_and_videos(cli):
    # Hand-computed (see tests/encoder_parallel/test_inputs.cpp, issue 13):
    #   qwen2vl 56x56 image: 2 x 2 = 4; a 3-frame 56x56 video: 2 temporal
    #   groups of 2 x 2 = 8; qwen3vl (factor 32, >= 65536 px) 56x56 -> 256x256:
    #   8 x 8 = 64 tokens; its video processor bounds the clip (issue 23): 3
    #   frames 56x56 -> 64x64, 2 groups of 2 x 2 = 8; 480x640: 15 x 20 = 300.
    path = cli.write("media.csv", "image_id,width,height,frames\n"
                     "1,56,56,1\n2,56,56,3\n3,640,480,1\n")
    q2 = parse_tokens(cli.run("tokens", "--images", path, rc=PASSED))
    expect(q2 == [(1, 4), (2, 8), (3, 391)], f"qwen2vl tokens {q2}")
    q25 = parse_tokens(cli.run("tokens", "--model", "qwen2.5vl", "--images", path, rc=PASSED))
    expect(q25 == q2, f"qwen2.5vl has qwen2vl's rule: {q25}")
    q3 = parse_tokens(cli.run("tokens", "--model", "qwen3vl", "--images", path, rc=PASSED))
    expect(q3 == [(1, 64), (2, 8), (3, 300)], f"qwen3vl tokens {q3}")
    # A quoted file name with a comma does not shift the columns.
    quoted = cli.write("quoted.csv", 'image_id,file_name,width,height\n9,"a,b.jpg",640,480\n')
    expect(parse_tokens(cli.run("tokens", "--images", quoted, rc=PASSED)) == [(9, 391)],
           "quoted comma")
    # 3037000500^2 overflows int64: 128 x 128 tokens (max_pixels), not 4.
    huge = cli.write("huge.csv", "image_id,width,height\n1,3037000500,3037000500\n")
    expect(parse_tokens(cli.run("tokens", "--images", huge, rc=PASSED)) == [(1, 16384)], "huge")
    # A step on a batch mixing images and videos, for every model, passes its check.
    for model in ["qwen2vl", "qwen2.5vl", "qwen3vl"]:
        r = cli.run("step", "--images", path, "--model", model, "--ranks", 4, "--cp", 2, "--tp", 2,
                    "--sp", "--json", rc=PASSED)
        expect(json.loads(r.out)["check"]["passed"], r.describe())
        b = json.loads(r.out)["bytes"]  # video groups are routed by row like images
        expect(b["total"] == b["owner_minimum"], f"{model}: {b}")


@scenario
def qwen3vl_video_layout(cli):
    """Issue 23 item 3: a Qwen3-VL video is one span per temporal group with
    its timestamp and vision start/end tokens between them; the step plans
    and checks it."""
    # 4 frames of 256x256: two groups of 8 x 8 = 64 tokens, each after
    # "<0.2 seconds>" / "<1.2 seconds>" (6 tokens) and <|vision_start|>, then
    # <|vision_end|>: spans at 7 and 79 of a 144-token block. 3 frames of
    # 56x56: 64x64, groups of 4 at 7 and 19 of 24. An image: one span.
    path = cli.write("clips.csv", "image_id,width,height,frames\n"
                     "1,256,256,4\n2,56,56,3\n3,640,480,1\n")
    r = cli.run("tokens", "--model", "qwen3vl", "--layout", "--images", path, rc=PASSED)
    want = ["image_id,tokens,block_tokens,spans", "1,128,144,7:64 79:64", "2,8,24,7:4 19:4",
            "3,300,300,0:300"]
    expect(r.out.splitlines() == want, f"qwen3vl layout\n{r.describe()}")
    r = cli.run("tokens", "--layout", "--images", path, rc=PASSED)
    want = ["image_id,tokens,block_tokens,spans", "1,162,162,0:162", "2,8,8,0:8",
            "3,391,391,0:391"]
    expect(r.out.splitlines() == want, f"qwen2vl layout: one span per clip\n{r.describe()}")
    # The step on videos only (the 4-frame clip, one per sample): every
    # sample holds two spans of 64 tokens; the reference check passes on
    # every exchange mode.
    one = cli.write("one_clip.csv", "image_id,width,height,frames\n1,256,256,4\n")
    for ranks, cp, tp, sp, layout in [(1, 1, 1, False, "contiguous"), (4, 1, 4, True, "contiguous"),
                                      (4, 2, 2, True, "zigzag"), (8, 2, 2, False, "contiguous")]:
        j = step_case(cli, ranks, cp, tp, sp, layout,
                      extra=["--images", one, "--model", "qwen3vl", "--batch", 2,
                             "--images-per-sample", 1])
        dp = ranks // (cp * tp)
        expect(j["images"] == 2 * dp * 2, f"two spans per clip: images {j['images']}")
        expect(j["image_tokens"] == 128 * dp * 2, f"image_tokens {j['image_tokens']}")
    # Seeds change the text, not the layout inside a block: a sweep passes.
    r = cli.run("sweep", "--seeds", "0..3", "--images", path, "--model", "qwen3vl", "--ranks", 4,
                "--cp", 2, "--tp", 2, "--sp", rc=PASSED)


@scenario
def command_line_edges(cli):
    """Issue 13 item 11: every edge exits 2 with one line naming the flag."""
    def bad(args, needle):
        r = cli.run(*args, rc=BAD_ARGS)
        lines = r.err.strip().splitlines()
        expect(len(lines) == 1, f"one line expected\n{r.describe()}")
        expect(needle in lines[0], f"the message does not name {needle}\n{r.describe()}")
        expect(r.out.strip() == "", f"a bad argument prints no report\n{r.describe()}")
    top = "18446744073709551615"
    bad(["sweep", "--seeds", "18446744073709551616..18446744073709551616"], "--seeds")
    bad(["step", "--seed", "18446744073709551616"], "--seed")
    bad(["step", "--seed", "-1"], "--seed")
    bad(["step", "--dp", 4096, "--cp", 1024, "--tp", 1024], "--cp")
    bad(["step", "--dp", 4096, "--cp", 2, "--tp", 4], "--dp")
    bad(["step", "--batch", 0], "--batch")
    bad(["step", "--hidden", 1048576], "--hidden")
    # The memory estimate's limit is the user's: a tiny one refuses the default
    # step and says how to raise it; zero or negative is refused outright.
    bad(["step", "--memory-limit", "0.001"], "raise --memory-limit")
    bad(["step", "--memory-limit", 0], "--memory-limit")
    bad(["step", "--memory-limit", -4], "--memory-limit")
    # NaN and infinities are no limit: refused (NaN passed the range check and disabled the guard).
    for value in ("nan", "NaN", "inf", "-inf"):
        bad(["step", "--memory-limit", value, "--hidden", 1048576], "--memory-limit")
    bad(["step", "--trace", "/dev/full"], "--trace")
    bad(["foo"], "unknown subcommand 'foo'")
    bad(["step", "--images", "/tmp"], "is a directory")
    # A FIFO is refused before it is opened (opening one waits for a writer: the step hung);
    # the same for a replay whose rank file is a FIFO or a directory (a directory was
    # std::bad_alloc). Each within the command's TIMEOUT_S, never a hang.
    fifo = cli.path("sizes.fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    bad(["step", "--images", fifo], "is a FIFO or socket")
    bad(["tokens", "--images", fifo], "is a FIFO or socket")
    for kind in ("fifo", "dir"):
        dumps = cli.path(f"dumps_{kind}")
        os.makedirs(dumps, exist_ok=True)
        rank0 = os.path.join(dumps, "rank-0.json")
        if not os.path.exists(rank0):
            os.mkfifo(rank0) if kind == "fifo" else os.makedirs(rank0)
        bad(["replay", dumps], "rank-0.json: is not a regular file" if kind == "fifo"
            else "rank-0.json: is a directory")
    bad(["step", "--fault", "rank:1"], "--fault")
    bad(["step", "--fault", "rank:99999999999:at:1"], "--fault")
    bad(["step", "--fault", "rank:0:at:0"], "--fault")
    bad(["step", "--model", "llava"], "--model")
    bad(["sweep", "--seeds", "1...2"], "--seeds")
    # The largest seed runs once and the sweep ends (the counter used to wrap to 0).
    r = cli.run("sweep", "--seeds", f"{top}..{top}", "--batch", 1, rc=PASSED)
    expect("sweep: 1 seeds, 1 passed, 0 failed" in r.out, r.describe())
    # float16 passes a meaningful check on the default mesh (the loss is
    # accumulated in float64; it used to overflow to inf).
    for dtype in ["float16", "bfloat16", "float32"]:
        j = json.loads(cli.run("step", "--dtype", dtype, "--json", rc=PASSED).out)
        expect(j["check"]["passed"] and j["check"]["loss_rel_diff"] < TOLERANCE[dtype][1],
               f"{dtype}: {j['check']}")


@scenario
def sweep_reproduce_line_quotes_paths(cli):
    # A forced wrong convention fails every seed; the reproduce line quotes an
    # --images path with a space and re-runs as printed.
    spaced = cli.write("with space.csv", open(cli.data, encoding="utf-8").read())
    r = cli.run("sweep", "--seeds", "0..0", "--tp", 2, "--ranks", 2, "--receiver-grad", "partial",
                "--images", spaced, rc=FAILED)
    m = re.search(r"reproduce: (.*)", r.out)
    expect(m, r.describe())
    line = m.group(1)
    expect(f"--images '{spaced}'" in line, f"the path is not quoted: {line}")
    import shlex
    argv = shlex.split(line)
    again = cli.run(*argv[1:], rc=FAILED)
    expect("FAILED" in again.out, again.describe())


# ----------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the scenario names and exit")
    ap.add_argument("--exe", help="the diffcomm-sim binary")
    ap.add_argument("--data", help="the shipped COCO image_sizes.csv")
    ap.add_argument("--workdir", help="scratch directory for files the scenario writes")
    ap.add_argument("scenario", nargs="?")
    a = ap.parse_args()
    if a.list:
        print("\n".join(SCENARIOS))
        return 0
    if not (a.exe and a.data and a.workdir and a.scenario):
        ap.error("--exe, --data, --workdir and a scenario are required")
    if a.scenario not in SCENARIOS:
        ap.error(f"unknown scenario {a.scenario!r}; known: {', '.join(SCENARIOS)}")
    cli = Cli(os.path.abspath(a.exe), os.path.abspath(a.data), os.path.abspath(a.workdir))
    try:
        SCENARIOS[a.scenario](cli)
    except Failure as e:
        print(f"FAIL cli_{a.scenario}:\n{e}", file=sys.stderr)
        return 1
    print(f"ok cli_{a.scenario}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
