#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (fuzz/corpus/<target>/): small valid inputs of each
format, plus a few near-misses, so the fuzzers start from files that reach deep into the readers.
The files are committed; run this again only to change them. Files named regress_* are inputs
that once broke a reader, kept as seeds (this script does not write them)."""
import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "I64": 8, "U8": 1, "U16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1}


def write(target, name, data):
    os.makedirs(os.path.join(ROOT, target), exist_ok=True)
    with open(os.path.join(ROOT, target, name), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None, pad=True):
    """tensors: [(name, dtype, shape)]; data bytes are a counting pattern."""
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:  # octet and the reference writer pad the header to 8 bytes with spaces
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(i % 251 for i in range(offset))


def shard(tokens, magic=20240520, version=1, count=None):
    header = [magic, version, len(tokens) if count is None else count] + [0] * 253
    return struct.pack("<256i", *header) + struct.pack("<%dH" % len(tokens), *tokens)


version = {"octet_format_version": "1"}
write("safetensors", "one_f32", safetensors([("w", "F32", [2, 3])], version))
write("safetensors", "mixed", safetensors(
    [("embed.weight", "BF16", [4, 8]), ("fp8.scale", "F32", [1]), ("fp8.data", "F8_E4M3", [3, 5]),
     ("step", "I64", []), ("empty", "U16", [0, 7])], dict(version, step="12", lr="0.002")))
write("safetensors", "e8m0_note", safetensors(
    [("block.scale_inv", "U8", [2, 4])], dict(version, **{"octet_dtype.block.scale_inv": "e8m0"})))
write("safetensors", "no_metadata_unpadded", safetensors([("x", "F16", [5])], None, pad=False))
write("safetensors", "empty_header", safetensors([], None))
write("safetensors", "overlap", struct.pack("<Q", 112) + json.dumps(
    {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
     "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
    separators=(",", ":")).encode().ljust(112) + bytes(16))

write("bin_shard", "gpt2_like", shard([50256, 464, 2068, 7586, 21831, 50256, 15496, 11, 995]))
write("bin_shard", "bytes", shard(list(b"37+48=85\n12-37=-25\n")))
write("bin_shard", "top_id", shard([0, 65535, 1, 2]))
write("bin_shard", "empty", shard([]))
write("bin_shard", "count_mismatch", shard([1, 2, 3], count=5))

write("text_source", "arithmetic", b"37+48=85\n12-37=-25\n6*7=42\nAlice has 3 cats.\n")
write("text_source", "utf8", "Grüße, 世界! ½ + ¼ = ¾\n".encode())
write("text_source", "one_byte", b"a")
write("text_source", "binary", b"PK\x03\x04\x00\x00binary")
