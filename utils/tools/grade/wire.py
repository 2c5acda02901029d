"""The only format that crosses between the trusted checker and the processes that run student code.

A frame is a JSON header and raw bytes:  8-byte length, JSON (UTF-8), 8-byte length, payload.
Tensors travel as descriptors in the header ({"dtype", "shape", "offset", "nbytes"}) pointing into the
payload: raw little-endian element bytes, never a pickle. Whatever arrives is checked (lengths capped,
dtypes from a fixed list, sizes consistent) before the checker looks at it, so a frame from a process
that ran student code can be wrong, but it cannot run code in the checker.
"""
from __future__ import annotations

import json
import struct

MAX_HEADER = 8 << 20     # bytes of JSON in one frame
MAX_PAYLOAD = 512 << 20  # bytes of tensor data in one frame
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
_LENGTH = struct.Struct(">Q")


class WireError(ValueError):
    """A frame that is truncated, too large or inconsistent."""


def write_frame(stream, header: dict, payload: bytes = b"") -> None:
    body = json.dumps(header, allow_nan=True).encode()
    stream.write(_LENGTH.pack(len(body)) + body + _LENGTH.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def _read_exactly(stream, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(min(left, 1 << 20))
        if not chunk:
            raise WireError(f"the stream ended inside a frame ({n - left} of {n} bytes read)")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(stream, max_payload: int = MAX_PAYLOAD):
    """(header, payload), or None when the stream ends cleanly between frames."""
    first = stream.read(_LENGTH.size)
    if not first:
        return None
    if len(first) < _LENGTH.size:
        first += _read_exactly(stream, _LENGTH.size - len(first))
    (size,) = _LENGTH.unpack(first)
    if size > MAX_HEADER:
        raise WireError(f"a frame header of {size} bytes (at most {MAX_HEADER})")
    try:
        header = json.loads(_read_exactly(stream, size))
    except (UnicodeDecodeError, ValueError) as error:
        if isinstance(error, WireError):
            raise
        raise WireError(f"a frame header that is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise WireError("a frame header that is not a JSON object")
    (size,) = _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))
    if size > max_payload:
        raise WireError(f"a frame payload of {size} bytes (at most {max_payload})")
    return header, _read_exactly(stream, size)


# ------------------------------------------------------------------ tensors as raw bytes

def pack(tensors) -> tuple[list, bytes]:
    """Descriptors and payload for a list of tensors (any device; copied to the CPU)."""
    import torch

    descriptors, parts, offset = [], [], 0
    for tensor in tensors:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        dtype = str(flat.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"a tensor of dtype {flat.dtype} cannot be sent")
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        descriptors.append({"dtype": dtype, "shape": [int(s) for s in tensor.shape], "offset": offset,
                            "nbytes": len(raw)})
        parts.append(raw)
        offset += len(raw)
    return descriptors, b"".join(parts)


def unpack(descriptors, payload: bytes) -> list:
    """The tensors a list of descriptors points to in payload; WireError if anything does not add up."""
    import math

    import torch

    if not isinstance(descriptors, list):
        raise WireError("tensor descriptors are not a list")
    tensors = []
    for d in descriptors:
        if not isinstance(d, dict) or d.get("dtype") not in DTYPES:
            raise WireError(f"a tensor descriptor with no allowed dtype: {str(d)[:100]}")
        shape, offset, nbytes = d.get("shape"), d.get("offset"), d.get("nbytes")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(type(s) is int and 0 <= s < 1 << 40 for s in shape)
                or type(offset) is not int or type(nbytes) is not int):
            raise WireError(f"a malformed tensor descriptor: {str(d)[:100]}")
        dtype = getattr(torch, d["dtype"])
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if size != nbytes or offset < 0 or offset + nbytes > len(payload):
            raise WireError(f"a tensor descriptor that does not match its bytes: {str(d)[:100]}")
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        raw = bytearray(payload[offset:offset + nbytes])
        tensors.append(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape))
    return tensors
