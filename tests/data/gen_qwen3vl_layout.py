#!/usr/bin/env python3
"""Writes tests/data/qwen3vl_video_layout.json: where transformers' real
Qwen3VLProcessor puts the video tokens of synthetic clips, token for token.

The C++ test (tests/encoder_parallel/test_qwen3vl_layout.cpp) compares
encoder_parallel::video_layout(qwen3vl_model(), frames, h, w) against every clip
of the file. This script is a one-off reference generator, not part of CI.

Generated with: transformers 5.24.0, torch 2.15.0+cu132 and torchvision 0.29.2+cu132
(PyPI's builds; the CPU is enough),
tiktoken 0.14.0, Python 3.11. How to run it (a scratch venv, ~4 GB with
PyPI's torch):

    python3 -m venv /tmp/q3venv
    /tmp/q3venv/bin/pip install transformers==5.24.0 tiktoken torch torchvision
    # The Qwen BPE vocabulary (151643 regular tokens, the same for Qwen2 and
    # Qwen3) ships in the dashscope wheel on PyPI:
    pip download dashscope==2.0.2 --no-deps -d /tmp/dsdl
    (cd /tmp/dsdl && unzip -o dashscope-2.0.2-py3-none-any.whl 'dashscope/resources/*')
    /tmp/q3venv/bin/python tests/data/gen_qwen3vl_layout.py \\
        --vocab /tmp/dsdl/dashscope/resources/qwen.tiktoken \\
        > tests/data/qwen3vl_video_layout.json

What runs: Qwen3VLProcessor(image_processor, tokenizer, video_processor) built
from the configs of Qwen/Qwen3-VL-*-Instruct (preprocessor_config.json,
video_preprocessor_config.json, below), a Qwen2Tokenizer built from the
tiktoken vocabulary with Qwen's special tokens at their ids, and the text
"<|video_pad|>" alone, so a token's position in input_ids is its offset from
the start of the block the processor writes for the clip. Each clip is
`frames` frames of height x width (uint8 noise), frames_indices 0..frames-1,
fps 2 (what Qwen3VLVideoProcessor samples at), do_sample_frames=False (the
frames are the sampled ones). cap_pixels_per_frame is left unset, as the Hub
config leaves it (transformers 5.24.0: uncapped). The ids are checked against
tiktoken's own encoding of the expanded text (special tokens split out).
"""
import argparse
import base64
import json
import re
import sys

import numpy as np
import tiktoken
import torch
import torchvision
import transformers
from transformers import (Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor,
                          Qwen3VLVideoProcessor)
from transformers.convert_slow_tokenizer import bytes_to_unicode

PRETOKENIZE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen2 / Qwen3 special tokens after the 151643 regular ones.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
           "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
           "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
           "<|image_pad|>", "<|video_pad|>"]
# Qwen/Qwen3-VL-*-Instruct preprocessor_config.json (images) and
# video_preprocessor_config.json (videos).
IMAGE_CONFIG = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5]}
VIDEO_CONFIG = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "fps": 2, "min_frames": 4, "max_frames": 768,
                "do_sample_frames": True}
FPS = 2.0
# (height, width): below the factor (upscaled), tiny (clip min bound), small,
# the 256 x 256, non-square both ways, thin, and large (clip max bound).
SIZES = [(20, 30), (32, 32), (56, 56), (256, 256), (480, 640), (720, 405), (40, 3000),
         (1080, 1920), (2160, 3840)]
FRAMES = range(1, 10)
# Longer clips for two-digit timestamps ("<10.2 seconds>" is 7 tokens).
LONG = [(22, 56, 56), (41, 32, 32)]


def load_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def build_tokenizer(ranks):
    byte_encoder = bytes_to_unicode()

    def s(b):
        return "".join(byte_encoder[c] for c in b)

    vocab = {s(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        if len(tok) == 1:
            continue
        local = [(tok[:i], tok[i:], rank) for i in range(1, len(tok))
                 if tok[:i] in ranks and tok[i:] in ranks]
        local.sort(key=lambda x: (ranks[x[0]], ranks[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: x[2])
    merges = [(s(a), s(b)) for a, b, _ in merges]
    n = len(ranks)
    for i, tok in enumerate(SPECIAL):
        vocab[tok] = n + i
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=SPECIAL[1:])
    for t in SPECIAL:
        assert tok.convert_tokens_to_ids(t) == vocab[t], t
    return tok


def tiktoken_ids(enc, special_ids, text):
    ids = []
    for piece in re.split("(" + "|".join(map(re.escape, SPECIAL)) + ")", text):
        if piece in special_ids:
            ids.append(special_ids[piece])
        elif piece:
            ids.extend(enc.encode(piece))
    return ids


def runs(ids, video_id):
    out, k = [], 0
    while k < len(ids):
        if ids[k] == video_id:
            start = k
            while k < len(ids) and ids[k] == video_id:
                k += 1
            out.append([start, k - start])
        else:
            k += 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", required=True, help="qwen.tiktoken (base64 token, rank per line)")
    args = ap.parse_args()
    ranks = load_ranks(args.vocab)
    enc = tiktoken.Encoding("qwen", pat_str=PRETOKENIZE, mergeable_ranks=ranks, special_tokens={})
    special_ids = {t: len(ranks) + i for i, t in enumerate(SPECIAL)}
    tokenizer = build_tokenizer(ranks)
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**IMAGE_CONFIG),
                                 tokenizer=tokenizer,
                                 video_processor=Qwen3VLVideoProcessor(**VIDEO_CONFIG))
    video_id = special_ids["<|video_pad|>"]
    rng = np.random.default_rng(0)
    clips = []
    cases = [(n, h, w) for h, w in SIZES for n in FRAMES] + LONG
    for n, h, w in cases:
        video = rng.integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)
        meta = {"total_num_frames": n, "fps": FPS, "frames_indices": list(range(n)),
                "height": h, "width": w}
        clip = {"frames": n, "height": h, "width": w}
        try:
            out = processor(text=["<|video_pad|>"], videos=[video], video_metadata=[meta],
                            do_sample_frames=False, return_text_replacement_offsets=True)
        except ValueError as e:  # e.g. fewer frames than temporal_patch_size
            clip["error"] = str(e)
            clips.append(clip)
            print(f"{n} x {h} x {w}: {e}", file=sys.stderr)
            continue
        ids = list(out["input_ids"][0])
        text = out["text_replacement_offsets"][0][0]["replacement"]
        assert tiktoken_ids(enc, special_ids, text) == ids, (n, h, w, text)
        grid = [int(v) for v in out["video_grid_thw"][0]]
        clip.update({
            "grid_thw": grid,
            "block_tokens": len(ids),
            "runs": runs(ids, video_id),
            "timestamps": re.findall(r"<[0-9.]+ seconds>", text),
        })
        clips.append(clip)
        print(f"{n} x {h} x {w}: grid {grid}, block {len(ids)}, runs {clip['runs']}",
              file=sys.stderr)
    doc = {
        "generator": "tests/data/gen_qwen3vl_layout.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "tiktoken": tiktoken.__version__,
        "fps": FPS,
        "video_preprocessor_config": VIDEO_CONFIG,
        "note": "runs: [offset, length] of each run of <|video_pad|> tokens, offsets from the "
                "start of the block that replaces the clip's <|video_pad|> placeholder",
        "clips": clips,
    }
    # One clip per line, so a diff shows which clip changed.
    head = json.dumps({k: v for k, v in doc.items() if k != "clips"}, indent=1)
    sys.stdout.write(head[:-2] + ',\n "clips": [\n')
    sys.stdout.write(",\n".join("  " + json.dumps(c) for c in clips))
    sys.stdout.write("\n ]\n}\n")


if __name__ == "__main__":
    main()
