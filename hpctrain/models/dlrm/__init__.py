"""A DLRM-style recommendation model (embedding tables, bottom and top MLPs, pairwise
dot-product interaction) predicting ratings."""

from hpctrain.models.dlrm.model import DLRM, DLRMCache

__all__ = ["DLRM", "DLRMCache"]
