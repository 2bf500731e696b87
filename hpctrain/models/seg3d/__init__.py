"""The 3-D segmentation net (``model.py``): a small U-Net predicting tissue classes per
voxel, data parallel and spatially parallel (slabs of depth), BatchNorm synchronised
over both."""

from hpctrain.models.seg3d.model import Seg3D, Seg3DCache

__all__ = ["Seg3D", "Seg3DCache"]
