"""Checkpoints: sharded HDF5, atomic, checksummed, loadable at any parallel layout.

``format`` names the files, the index and the checksums, ``reshard`` holds the
slice maths (which box of each global tensor a rank holds), ``state`` what a rank
holds of the training state, ``writer`` and ``reader`` the two directions
(``background`` writes from a thread while training goes on), ``consolidate`` the
single-file form, ``verify`` what ``hpctrain ckpt verify`` reads,
``training`` the calls ``hpctrain.train`` makes.
"""

from hpctrain.checkpoint.format import CheckpointError
from hpctrain.checkpoint.reader import Checkpoint
from hpctrain.checkpoint.training import find_resume, load_training, save_training
from hpctrain.checkpoint.verify import verify

__all__ = ["Checkpoint", "CheckpointError", "find_resume", "load_training", "save_training",
           "verify"]
