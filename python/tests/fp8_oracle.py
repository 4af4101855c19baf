"""The FP8 block rule written from its definition (DeepGEMM's
per_block_cast_to_fp8; docs/api.md, "Quantized in flight"), in numpy, for
the Python tests: not ferry's routine."""

import numpy as np


def e4m3_values():
    """The value of each byte 0x00-0x7e of e4m3 (0x7f is NaN), from the
    format: 4 exponent bits (bias 7), 3 mantissa bits."""
    out = []
    for c in range(0x7f):
        e, m = (c >> 3) & 0xF, c & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.array(out)


def oracle(x, block=128):
    """DeepGEMM's per_block_cast_to_fp8 on a float32 array of bf16 values:
    (e4m3 bytes as uint8, float32 scales)."""
    values = e4m3_values()
    rows, cols = x.shape
    q = np.zeros(x.shape, np.uint8)
    scales = np.zeros(((rows + block - 1) // block, (cols + block - 1) // block),
                      np.float32)
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            b = x[i:i + block, j:j + block]
            amax = np.maximum(np.abs(b).max(), np.float32(1e-4)).astype(np.float32)
            v = (b * (np.float32(448.0) / amax)).astype(np.float32)
            a = np.abs(v).astype(np.float64)
            hi = np.clip(np.searchsorted(values, a), 0, len(values) - 1)
            lo = np.clip(hi - 1, 0, len(values) - 1)
            d_hi, d_lo = np.abs(values[hi] - a), np.abs(values[lo] - a)
            code = np.where(d_lo < d_hi, lo, hi)
            tie = d_lo == d_hi
            code = np.where(tie, np.where(lo % 2 == 0, lo, hi), code)
            code = np.where(a >= values[-1], len(values) - 1, code)
            q[i:i + block, j:j + block] = code | np.where(np.signbit(v), 0x80, 0)
            scales[i // block, j // block] = amax / np.float32(448.0)
    return q, scales
