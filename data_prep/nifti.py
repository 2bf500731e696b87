"""A reader of single-file NIfTI-1 images (``.nii`` or ``.nii.gz``), without nibabel.

The 348-byte header, at the offsets of the NIfTI-1 standard (nifti1.h)::

    offset  field          type       use here
       0    sizeof_hdr     int32      348; read in either byte order, it gives the order
      40    dim[8]         int16      dim[0] = number of axes n, dim[1..n] their sizes
      70    datatype       int16      2 u1, 4 i2, 8 i4, 16 f4, 64 f8, 256 i1, 512 u2, 768 u4
      72    bitpix         int16      bits per voxel, must agree with datatype
      76    pixdim[8]      float32    pixdim[1..n]: voxel spacing (mm for the template)
     108    vox_offset     float32    where the voxels start in the file (>= 348)
     112    scl_slope      float32    value = slope * stored + inter, unless slope is 0
     116    scl_inter      float32    (or not finite), or (slope, inter) is (1, 0)
     344    magic          char[4]    "n+1\\0": header and data in one file

Voxels are stored with the first axis fastest (Fortran order), so the array returned
is indexed ``a[i, j, k]`` like the NIfTI voxel coordinates. The affine (qform/sform)
is not read: callers that need an orientation check it themselves.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np

from hpctrain.data.format import DataError

HEADER_SIZE = 348
DTYPES = {2: "u1", 4: "i2", 8: "i4", 16: "f4", 64: "f8", 256: "i1", 512: "u2", 768: "u4"}
_NAMES = {2: "uint8", 4: "int16", 8: "int32", 16: "float32", 64: "float64", 256: "int8",
          512: "uint16", 768: "uint32"}
_KNOWN = {32: "complex64", 128: "RGB24", 1024: "int64", 1280: "uint64", 1536: "float128",
          1792: "complex128", 2048: "complex256", 2304: "RGBA32"}


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped if they start with the gzip magic 1f 8b."""
    try:
        raw = path.read_bytes()
        return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise DataError(f"{path}: not a readable gzip file ({err}; truncated or "
                        f"corrupt)") from None


def read_nifti(path: str | Path) -> tuple[np.ndarray, tuple[float, ...]]:
    """``(data, spacing)``: data (dim[1], ..., dim[n]) in its stored dtype, or float
    (float64 for 4- and 8-byte types, float32 otherwise) when scl_slope applies;
    spacing is pixdim[1..n]."""
    path = Path(path)
    raw = read_bytes(path)
    if len(raw) < HEADER_SIZE:
        raise DataError(f"{path}: {len(raw)} bytes, shorter than a NIfTI-1 header "
                        f"({HEADER_SIZE}); truncated or not NIfTI")
    order = _byte_order(raw, path)
    dim = struct.unpack_from(f"{order}8h", raw, 40)
    datatype, bitpix = struct.unpack_from(f"{order}2h", raw, 70)
    pixdim = struct.unpack_from(f"{order}8f", raw, 76)
    vox_offset, slope, inter = struct.unpack_from(f"{order}3f", raw, 108)
    n = dim[0]
    if not 1 <= n <= 7 or any(d < 1 for d in dim[1:n + 1]):
        raise DataError(f"{path}: bad NIfTI-1 dim {list(dim)} (dim[0] must be 1..7 and "
                        f"the sizes positive)")
    shape = tuple(int(d) for d in dim[1:n + 1])
    if datatype not in DTYPES:
        name = _KNOWN.get(datatype, "unknown")
        raise DataError(f"{path}: unsupported NIfTI datatype {datatype} ({name}); this "
                        f"reader takes {', '.join(_NAMES.values())}")
    dtype = np.dtype(DTYPES[datatype]).newbyteorder(order)
    if bitpix != 8 * dtype.itemsize:
        raise DataError(f"{path}: bitpix {bitpix} does not match datatype {datatype} "
                        f"({_NAMES[datatype]}, {8 * dtype.itemsize} bits)")
    if not math.isfinite(vox_offset) or vox_offset < HEADER_SIZE or vox_offset % 1:
        raise DataError(f"{path}: vox_offset {vox_offset} must be a whole number of bytes "
                        f"at or after the {HEADER_SIZE}-byte header")
    start, count = int(vox_offset), math.prod(shape)
    want = count * dtype.itemsize
    if len(raw) - start < want:
        raise DataError(f"{path}: truncated: {max(0, len(raw) - start)} bytes of voxels after "
                        f"vox_offset {start}, dim {list(shape)} of {_NAMES[datatype]} "
                        f"needs {want}")
    data = np.frombuffer(raw, dtype, count, start).reshape(shape, order="F")
    data = data.astype(dtype.newbyteorder("="))  # a native, writable copy
    if math.isfinite(slope) and math.isfinite(inter) and slope != 0 and (slope, inter) != (1, 0):
        out = np.float64 if dtype.itemsize >= 4 else np.float32
        data = data.astype(out) * out(slope) + out(inter)
    return data, tuple(float(p) for p in pixdim[1:n + 1])


def _byte_order(raw: bytes, path: Path) -> str:
    """``"<"`` or ``">"``: the order in which sizeof_hdr reads 348; magic "n+1"."""
    for order in "<>":
        if struct.unpack_from(f"{order}i", raw, 0)[0] == HEADER_SIZE:
            break
    else:
        size = struct.unpack_from("<i", raw, 0)[0]
        what = "NIfTI-2, which this reader does not take" if size in (540, 0x1C020000) else \
            f"sizeof_hdr {size}"
        raise DataError(f"{path}: not a NIfTI-1 file ({what}; NIfTI-1 has {HEADER_SIZE})")
    magic = raw[344:348]
    if magic == b"ni1\0":
        raise DataError(f"{path}: a NIfTI-1 header of a .hdr/.img pair; this reader takes "
                        f"single .nii/.nii.gz files (magic n+1)")
    if magic != b"n+1\0":
        raise DataError(f"{path}: not a NIfTI-1 file (magic {magic!r}, expected b'n+1\\x00')")
    return order
