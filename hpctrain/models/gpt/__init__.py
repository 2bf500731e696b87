"""The GPT: the model (``model.py``) and its tensor-parallel plan
(``tensor_parallel.py``, loaded only when tp > 1)."""

from hpctrain.models.gpt.model import (
    GPT,
    Block,
    BlockCache,
    Embed,
    EmbedCache,
    FeedForward,
    GPTCache,
    Head,
    HeadCache,
)

__all__ = ["GPT", "Block", "BlockCache", "Embed", "EmbedCache", "FeedForward", "GPTCache",
           "Head", "HeadCache"]
