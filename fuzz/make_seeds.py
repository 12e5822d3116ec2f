#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/corpus/<target>/ (checked in; rerun after
changing a harness's input layout). Each binary seed is encoded the way the
harness's diffcomm::fuzz::Input reads it: every integer from 8 little-endian
bytes, reduced into its range by the harness."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def u64(*values):
    return b"".join(struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF) for v in values)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# fuzz_tokens: preset?, [model fields], flag+h, flag+w, flag+frames.
# range(lo, hi) = lo + v % (hi - lo + 1)
write("fuzz_tokens", "qwen2vl_639x31", u64(1, 0) + u64(0, 639 + 2, 0, 31 + 2, 0, 1 + 2))
write("fuzz_tokens", "qwen3vl_video", u64(1, 2) + u64(0, 56 + 2, 0, 56 + 2, 0, 3 + 2))
write("fuzz_tokens", "custom_bounds",
      u64(0, 14 + 2, 2 + 2, 2 + 2, 0, 3136 + 10, 0, 15680 + 10) + u64(0, 639 + 2, 0, 31 + 2, 0, 3))
write("fuzz_tokens", "huge", u64(1, 0, 1, 3037000500, 1, 3037000500, 0, 3))

# fuzz_csv_batch: CSV text.
write("fuzz_csv_batch", "coco_head", "image_id,width,height,license\n139,640,426,2\n285,586,640,4\n"
      "632,640,483,3\n724,375,500,4\n776,428,640,3\n")
write("fuzz_csv_batch", "quoted", 'image_id,file_name,width,height\n1,"a,b.jpg",640,480\n'
      '2,"say \\"hi\\"",20,10\n')
write("fuzz_csv_batch", "videos", "\ufeffimage_id,width,height,frames\r\n7,56,56,3\r\n8,1280,720,16\r\n")
write("fuzz_csv_batch", "bad_cell", "image_id,width,height\n1,20,abc\n")
# Found by the fuzzer (CI, 2026-12-02): 556201 frames, a 28 s plan under ASAN
# before kMaxFrames became 2^16; now refused at the reader.
write("fuzz_csv_batch", "many_frames",
      b"\xef\xbb\xbfimage_id,width,height,frames\r\n7,56,8,0556201,,8\r,050,56\r\n")
# The largest accepted batch: four videos of 2^16 frames (85 bytes: the target picks Qwen3-VL,
# one work item per temporal group; 1.9 s in a Debug build).
write("fuzz_csv_batch", "max_frames",
      "image_id,width,height,frames\n1,56,8,65536\n2,8,56,65535\n3,56,56,65536\n4,28,28,65536\n\n\n")

# fuzz_plan_exchange: cp, tp, sp, zigzag, encoder_cp, override?, samples, per sample
# (seq_len, images, per image (start, tokens)), corrupt?, [what, args], seed.
design = u64(1, 1, 1, 0, 0, 0, 1, 16, 1, 5, 6, 0, 0)  # cp 2, tp 2, sp: DESIGN's example
write("fuzz_plan_exchange", "design_example", design)
write("fuzz_plan_exchange", "item_id_100", u64(1, 1, 1, 0, 0, 0, 1, 16, 1, 5, 6, 1, 0, 0, 102, 0))
write("fuzz_plan_exchange", "tp_all_gather", u64(0, 1, 0, 0, 0, 0, 2, 12, 2, 0, 4, 6, 4, 8, 1, 2, 3, 0, 0))
write("fuzz_plan_exchange", "bad_destination",
      u64(1, 1, 1, 1, 0, 0, 1, 16, 1, 5, 6, 1, 4, 0, 9 + 2, 0))

# fuzz_cli: count, then per argument (kind, index): 0 word, 1 value, 2 raw text.
WORDS = ["step", "check", "sweep", "tokens", "foo", "--ranks", "--dp", "--cp", "--tp", "--sp",
         "--cp-layout", "--encoder-buckets", "--encoder-cp", "--batch", "--images-per-sample",
         "--hidden", "--ffn", "--dtype", "--seed", "--images", "--json", "--fault", "--trace",
         "--receiver-grad", "--model", "--op", "--seeds", "--help", "--no-such-flag"]
VALUES = ["0", "1", "2", "3", "4", "-1", "18446744073709551615", "18446744073709551616",
          "99999999999", "1048576", "2147483648", "0..1", "5..3", "1...2", "rank:0:at:1",
          "rank:1:at:0", "rank:9:at:2", "float16", "bfloat16", "int8", "zigzag", "qwen3vl",
          "qwen2.5vl", "partial", "all_reduce", "all_to_all_single", "/tmp", "/dev/full",
          "/dev/null", "/nonexistent", "", "x"]


def cli(*args):
    out = [len(args)]
    for a in args:
        if a in WORDS:
            out += [0, WORDS.index(a)]
        else:
            out += [1, VALUES.index(a)]
    return u64(*out)


write("fuzz_cli", "step_4_ranks", cli("step", "--ranks", "4", "--cp", "2", "--tp", "2", "--sp"))
write("fuzz_cli", "step_fault", cli("step", "--ranks", "4", "--tp", "4", "--fault", "rank:1:at:0"))
write("fuzz_cli", "sweep_top", cli("sweep", "--seeds", "18446744073709551615", "--batch", "1"))
write("fuzz_cli", "tokens_qwen3", cli("tokens", "--model", "qwen3vl"))
write("fuzz_cli", "check_op", cli("check", "--op", "all_to_all_single", "--ranks", "3", "--seed", "1"))
write("fuzz_cli", "trace_full", cli("step", "--trace", "/dev/full", "--dtype", "float16"))

# fuzz_dlpack: device cpu?, code, bits flag+exp, lanes flag, ndim flag+value,
# 8 x (flag, dim), strides?, 8 x (flag, stride), byte_offset.
def dl(code, bits_exp, shape, strides=None, offset=0):
    out = [1, code, 1, bits_exp, 1, 1, len(shape)]
    dims = list(shape) + [1] * (8 - len(shape))
    for d in dims:
        out += [1, d]
    out += [1 if strides else 0]
    st = list(strides or []) + [1] * (8 - len(strides or []))
    for s in st:
        out += [1, s]
    out += [offset]
    return u64(*out)


write("fuzz_dlpack", "float32_2x3", dl(2, 2, [2, 3]))
write("fuzz_dlpack", "int64_strided", dl(0, 3, [2, 3], [3, 1], 1))
write("fuzz_dlpack", "noncontiguous", dl(2, 3, [2, 3], [1, 2]))
write("fuzz_dlpack", "negative_ndim", u64(1, 2, 1, 2, 1, 1, 0, 0))

# fuzz_flight_dump: dumps as bench/replay_synthetic.py writes them (format 2,
# TP + world calls; a rank whose description disagrees), a version 1 dump.
import importlib.util  # noqa: E402

spec = importlib.util.spec_from_file_location(
    "replay_synthetic", os.path.join(HERE, "..", "bench", "replay_synthetic.py"))
synthetic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(synthetic)
write("fuzz_flight_dump", "v2_ok_rank0", synthetic.dump(0, 16, 4, "ok"))
write("fuzz_flight_dump", "v2_mismatch_last", synthetic.dump(15, 16, 4, "mismatch"))
write("fuzz_flight_dump", "v1_one_entry",
      '{"format":"diffcomm-flight-recorder","version":1,"rank":0,"world_size":1,"capacity":4,'
      '"groups":[{"name":"world","members":[0],"group_rank":0,"calls":1,"p2p_calls":0,'
      '"watermark":0,"p2p_watermark":0}],"entries":[{"id":1,"group":"world","group_rank":0,'
      '"group_size":1,"call":0,"op":"all_reduce","dtype":"float32","numel":2,'
      '"input_shapes":[[2]],"output_shapes":[[2]],"input_splits":[],"output_splits":[],'
      '"root":-1,"tag":0,"reduce_op":"sum","reduce_factor":1.0,"color":-1,"key":0,"members":[],'
      '"members_are_ranks":false,"backward_of":null,"state":"completed","start_s":0.0,'
      '"duration_s":0.0,"bytes_sent":8,"bytes_received":8}]}')

# fuzz_unpickle, fuzz_torch_dump: rank 0 of each checked-in PyTorch dump
# (tests/data/torch_fr: real gloo jobs), and for the pickle reader a memo bomb
# (a list of two references to the previous list, 40 deep: 2^40 values if
# memo gets copied without a budget).
FIXTURES = os.path.join(HERE, "..", "tests", "data", "torch_fr")
for case in sorted(os.listdir(FIXTURES)):
    for ext in ("pkl", "json"):
        path = os.path.join(FIXTURES, case, f"rank_0.{ext}")
        if not os.path.exists(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        write("fuzz_torch_dump", f"{case}-rank_0.{ext}", data)
        if ext == "pkl":
            write("fuzz_unpickle", f"{case}-rank_0.pkl", data)
bomb = b"\x80\x02]q\x00" + b"](h\x00h\x00eq\x00" * 40 + b"."
write("fuzz_unpickle", "memo_bomb", bomb)
