"""HDF5 datasets and the loader each data-parallel rank reads its batches with.

``format`` holds the on-disk formats (names, versions, checks, checksums, atomic
writes), ``manifest`` the partition manifests and the shard-to-rank assignment,
``stores`` the readers of token windows and image rows, ``loader`` the batch streams,
``volumes`` the training crops and evaluation tiles of one 3-D volume.
"""

from hpctrain.data.format import DataError
from hpctrain.data.loader import Loader, eval_batches, open_loader
from hpctrain.data.manifest import assign_shards, read_manifest

__all__ = ["DataError", "Loader", "assign_shards", "eval_batches", "open_loader",
           "read_manifest"]
