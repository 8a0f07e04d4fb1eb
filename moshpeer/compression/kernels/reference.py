"""Pure-torch reference of the compiled kernels: the definition every backend must match (quantization: bit for bit).

The function, for a float32 vector `x` cut into blocks of `block` values (the last block may be short):

    absmax_b = max_i |x_i|                       over the block (NaN/inf -> the encoder refuses the input)
    scale_b  = absmax_b / qmax                   (float32 division; qmax = 127 for int8, 7 for int4, 1 for int2)
    inv_b    = qmax / absmax_b                   (float32 division)
    if inv_b is not finite (absmax_b == 0 or below qmax / FLT_MAX): scale_b = inv_b = 0 (all codes 0)
    y_i      = x_i * inv_b                       (one float32 multiplication)
    nearest:    q_i = round_half_even(y_i)
    stochastic: q_i = sign(y_i) * (floor(|y_i|) + [u_i < |y_i| - floor(|y_i|)]),  u_i = h(i ^ key) >> 8, scaled by 2^-24
    q_i      = clamp(q_i, -qmax, qmax)

and decoding with weight `w` (a float32):  out_i = out_i + q_i * float32(scale_b * w)  (two roundings, no FMA).

Every operation is a single IEEE float32 operation or an exact integer one, so C++, CUDA and this file agree
bit for bit as long as no compiler fuses multiply and add (the builds pass -ffp-contract=off / use __fmul_rn).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
QMAX = {8: 127, 4: 7, 2: 1}  # int2 is ternary: codes -1, 0, 1 (-2 is never written)
COMPILED_BITS = (8, 4)  # the C++ and CUDA kernels' widths; int2 runs this reference on every device


def _mul32(x, c: int):
    """(x * c) mod 2^32 for values in [0, 2^32) held in int64 (or Python ints) without signed overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x):
    """A 32-bit integer mixer (the "lowbias32" constants); works on Python ints and int64 tensors alike.

    Used as a counter-based RNG: u_i = hash32(i ^ key). Must match `mp_hash32` in quant_math.h.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def rng_key(seed: int) -> int:
    """Derive the 32-bit stream key from a 64-bit seed (Python side, shared by every backend)."""
    seed &= (1 << 64) - 1
    return hash32(hash32((seed & MASK32) ^ 0x9E3779B9) ^ (seed >> 32))


def uniform24(numel: int, key: int, device=None) -> torch.Tensor:
    """The stochastic-rounding thresholds u_i = hash32(i ^ key) >> 8 as an int64 tensor in [0, 2^24)."""
    index = torch.arange(numel, dtype=torch.int64, device=device)
    return hash32(index ^ key) >> 8


def num_blocks(numel: int, block: int) -> int:
    return (numel + block - 1) // block


def quantize(x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, bits: int, block: int,
             stochastic: bool, key: int) -> bool:
    """Quantize float32 contiguous 1-D `x` into `scales` (float32, one per block) and `codes` (uint8).

    int8: one code byte per value. int4: value 2j in the low nibble of byte j, value 2j+1 in the high one
    (a final odd value leaves the high nibble 0). int2: value 4j + i in bits 2i..2i+1 of byte j (unused trailing
    pairs 0). Returns False (outputs unspecified) on non-finite input.
    """
    numel = x.numel()
    if numel == 0:
        return True
    qmax = QMAX[bits]
    nb = num_blocks(numel, block)
    padded = torch.nn.functional.pad(x, (0, nb * block - numel)).view(nb, block)
    absmax = padded.abs().amax(dim=1)
    if not bool(torch.isfinite(absmax).all()):
        return False
    qmax_t = torch.tensor(float(qmax), dtype=torch.float32, device=x.device)
    scale = absmax / qmax_t
    inv = qmax_t / absmax
    zero = ~torch.isfinite(inv)
    scale = scale.masked_fill(zero, 0.0)
    inv = inv.masked_fill(zero, 0.0)
    y = (padded * inv[:, None]).reshape(-1)[:numel]
    if stochastic:
        mag = y.abs()
        low = torch.floor(mag)
        frac = mag - low
        u = uniform24(numel, key, device=x.device).to(torch.float32)
        up = (u < frac * 16777216.0).to(torch.float32)
        q = torch.copysign(low + up, y)
    else:
        q = torch.round(y)
    q = q.clamp(-qmax, qmax).to(torch.int16)  # only ever active for stochastic rounding (see quant_math.h)
    scales.copy_(scale)
    if bits == 8:
        codes.copy_(q.to(torch.int8).view(torch.uint8))
    elif bits == 4:
        nib = (q & 0xF).to(torch.uint8)
        if numel % 2:
            nib = torch.cat([nib, nib.new_zeros(1)])
        codes.copy_(nib[0::2] | (nib[1::2] << 4))
    else:
        pairs = (q & 0x3).to(torch.uint8)
        pairs = torch.cat([pairs, pairs.new_zeros(-numel % 4)]).view(-1, 4)
        codes.copy_(pairs[:, 0] | (pairs[:, 1] << 2) | (pairs[:, 2] << 4) | (pairs[:, 3] << 6))
    return True


def code_nbytes(numel: int, bits: int) -> int:
    """Bytes of the codes of `numel` values."""
    return (numel * bits + 7) // 8


def unpack_codes(codes: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The signed integer codes (int16) of `numel` values."""
    if bits == 8:
        return codes.view(torch.int8).to(torch.int16)
    if bits == 2:
        pairs = torch.stack([(codes >> shift) & 0x3 for shift in (0, 2, 4, 6)], dim=1).reshape(-1)[:numel]
        pairs = pairs.to(torch.int16)
        return pairs - ((pairs & 0x2) << 1)  # sign-extend 2 bits
    lo = (codes & 0xF).to(torch.int16)
    hi = (codes >> 4).to(torch.int16)
    nib = torch.stack([lo, hi], dim=1).reshape(-1)[:numel]
    return nib - ((nib & 0x8) << 1)  # sign-extend 4 bits


def dequantize_accumulate(scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, bits: int, block: int,
                          weight: float) -> None:
    """out += q * float32(scale * weight), block by block (inputs already validated)."""
    numel = out.numel()
    if numel == 0:
        return
    nb = num_blocks(numel, block)
    w = torch.tensor(weight, dtype=torch.float32, device=out.device)
    scaled = scales * w
    q = unpack_codes(codes, bits, numel).to(torch.float32)
    q = torch.nn.functional.pad(q, (0, nb * block - numel)).view(nb, block)
    values = (q * scaled[:, None]).reshape(-1)[:numel]
    out.add_(values)


def dequantize(scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, bits: int, block: int,
               weight: float) -> None:
    """out = q * float32(scale * weight): dequantize_accumulate onto zeros (0.0 + v, the same bits)."""
    out.zero_()
    dequantize_accumulate(scales, codes, out, bits, block, weight)


# quantize_rows status bits, per row (the compiled kernels set the same ones)
ROW_NONFINITE = 1
ROW_SCALE_TOO_LARGE = 2


def quantize_rows(x: torch.Tensor, rows: torch.Tensor, header: bytes, status: torch.Tensor, bits: int, block: int,
                  max_scale: float) -> None:
    """Encode R = rows.shape[0] chunks of n = x.numel() / R values (n a multiple of `block`) into the rows of
    `rows` (uint8, R x stride), each laid out as a payload: `header`, then the chunk's scales, then its codes (the
    bytes `quantize` gives for that chunk alone). `status[r]` (int32) is set to ROW_NONFINITE if chunk r holds
    a non-finite value (its row is then unspecified), or ROW_SCALE_TOO_LARGE if a scale exceeds `max_scale`."""
    count = rows.shape[0]
    if count == 0:
        return
    n = x.numel() // count
    nb, cb = n // block, code_nbytes(n, bits)
    h = len(header)
    values = x.view(count, n)
    finite = torch.isfinite(values).all(dim=1)
    scales = torch.empty(count, nb, dtype=torch.float32, device=x.device)
    codes = torch.empty(count, cb, dtype=torch.uint8, device=x.device)
    # Chunks are whole blocks, so quantizing them together gives each one's bytes; a non-finite row is zeroed.
    quantize(torch.where(finite[:, None], values, 0.0).view(-1), scales.view(-1), codes.view(-1), bits, block,
             False, 0)
    rows[:, :h].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(rows.device))
    rows[:, h:h + 4 * nb].copy_(scales.view(torch.uint8))
    rows[:, h + 4 * nb:h + 4 * nb + cb].copy_(codes)
    too_large = (scales > max_scale).any(dim=1)
    status.copy_(torch.where(finite, torch.where(too_large, ROW_SCALE_TOO_LARGE, 0), ROW_NONFINITE).to(torch.int32))


def dequantize_rows(rows: torch.Tensor, out: torch.Tensor, bits: int, block: int, weight: float,
                    overwrite: bool) -> None:
    """The inverse of `quantize_rows`: with R = rows.shape[0] and n = out.numel() / R, out[r*n:(r+1)*n] = (or, without
    `overwrite`, +=) weight * the values of the payload in row r, read where its scales and codes lie in the row.
    Rows must be validated already (scales finite, non-negative, bounded)."""
    count = rows.shape[0]
    if count == 0:
        return
    n = out.numel() // count
    nb, cb = n // block, code_nbytes(n, bits)
    scales = rows[:, 16:16 + 4 * nb].reshape(-1).view(torch.float32)
    codes = rows[:, 16 + 4 * nb:16 + 4 * nb + cb].reshape(-1)
    (dequantize if overwrite else dequantize_accumulate)(scales, codes, out, bits, block, weight)


MODE_SKIP, MODE_INTO, MODE_ADD = 0, 1, 2  # take_float_rows: what to do with a row


def take_float_rows(values: torch.Tensor, out: torch.Tensor, modes, weight: float) -> list:
    """Raw float32 payload rows (the `none` codec): with R = values.shape[0] and n = out.numel() / R, row r's first n
    values go into out[r*n:(r+1)*n] by modes[r] (MODE_INTO: weight * row; MODE_ADD: out + weight * row; MODE_SKIP:
    nothing), but only if all of them are finite: a row with NaN or inf is refused whole, before anything is
    written. -> per row, 1 if refused, else 0. One read-back for the batch (two if a row's sum overflows)."""
    count = values.shape[0]
    if count == 0:
        return []
    n = out.numel() // count
    rows = values[:, :n]
    finite = torch.isfinite(rows.sum(dim=1, dtype=torch.float32)).tolist()
    if not all(finite):
        finite = torch.isfinite(rows).all(dim=1).tolist()
    refused = [0 if finite[r] or modes[r] == MODE_SKIP else 1 for r in range(count)]
    r = 0
    while r < count:  # each run of accepted rows with one mode: one operation
        end = r + 1
        if modes[r] != MODE_SKIP and not refused[r]:
            while end < count and modes[end] == modes[r] and not refused[end]:
                end += 1
            target, source = out[r * n:end * n].view(end - r, n), rows[r:end]
            if modes[r] == MODE_ADD:
                target.add_(source, alpha=weight)
            elif weight == 1.0:
                target.copy_(source)
            else:
                torch.mul(source, weight, out=target)
        r = end
    return refused


def estimate_chunks(total: torch.Tensor, own: torch.Tensor, chunk_numel: int, k1: float, k2: float) -> list:
    """The owner's estimate (averaging/estimator.py), chunk by chunk: total = total * k1 + own * k2 in place, then
    each chunk of `chunk_numel` values (the last may be shorter) is copied into `own` only if all of it is finite.
    -> per chunk, 1 if its estimate was not finite (`own` keeps its values there), else 0. One read-back for the
    run when every chunk is finite."""
    numel = own.numel()
    count = -(-numel // chunk_numel)
    total.mul_(k1).add_(own, alpha=k2)
    if bool(torch.isfinite(total).all()):
        own.copy_(total)
        return [0] * count
    refused = []
    for c in range(count):  # some chunk is not finite: find which (rare)
        lo, hi = c * chunk_numel, min(numel, (c + 1) * chunk_numel)
        finite = bool(torch.isfinite(total[lo:hi]).all())
        if finite:
            own[lo:hi].copy_(total[lo:hi])
        refused.append(0 if finite else 1)
    return refused


def bad_scale_rows(rows: torch.Tensor, nb: int, max_scale: float) -> list:
    """Per payload row of `rows` (2-D uint8, the `nb` float32 scales at byte offset 16 of each row): 1 if a scale is
    non-finite, negative or above `max_scale` (the decoder refuses the row), else 0. One read-back."""
    if rows.shape[0] == 0:
        return []
    scales = rows[:, 16:16 + 4 * nb].contiguous().view(torch.float32)
    return (~torch.isfinite(scales) | (scales < 0) | (scales > max_scale)).any(dim=1).to(torch.int64).tolist()
