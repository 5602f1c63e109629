"""FP8 codes computed independently of octet: the nearest code by search over every code, ties to
the even code, saturating to the largest finite value (CUDA's __NV_SATFINITE)."""
import numpy as np

FORMATS = {"e4m3": (3, 7, 0x7E), "e5m2": (2, 15, 0x7B)}  # mantissa bits, bias, largest code


def decode(codes, fmt):
    mbits, bias, _ = FORMATS[fmt]
    c = np.asarray(codes, dtype=np.int64)
    e, m = (c & 0x7F) >> mbits, c & ((1 << mbits) - 1)
    v = np.where(e == 0, np.ldexp(m.astype(np.float64), 1 - bias - mbits),
                 np.ldexp(1 + m / (1 << mbits), e - bias))
    return np.where(c & 0x80, -v, v).astype(np.float32)


def encode(values, fmt):
    _, _, top = FORMATS[fmt]
    v = np.asarray(values, dtype=np.float32).ravel()
    table = decode(np.arange(top + 1), fmt).astype(np.float64)
    diff = np.abs(np.abs(v.astype(np.float64))[:, None] - table[None, :])
    best = diff.min(axis=1, keepdims=True)
    ties = diff == best
    # The even code among the nearest (two nearest codes are neighbours, one of them even).
    even = ties & (np.arange(top + 1)[None, :] % 2 == 0)
    code = np.where(even.any(axis=1), even.argmax(axis=1), ties.argmax(axis=1))
    code = code | np.where(np.signbit(v), 0x80, 0)
    return code.astype(np.uint8).reshape(np.shape(values))


def floor_pow2(s):
    bits = np.asarray(s, dtype=np.float32).view(np.uint32) & np.uint32(0xFF800000)
    return bits.view(np.float32)
