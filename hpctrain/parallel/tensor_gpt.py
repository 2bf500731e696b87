"""Moved: the GPT's tensor-parallel plan now lives next to the model, in
``hpctrain.models.gpt.tensor_parallel``. This name stays for the code and tests that
import it from here; new code imports the model's module (``parallel/`` itself never
does: it reads ``Model.tensor_plan``)."""

from hpctrain.models.gpt.tensor_parallel import (  # noqa: F401
    SEQUENCE_PLAN,
    STYLES,
    TENSOR_PLAN,
    SequenceParallelAttention,
    SequenceParallelEmbed,
    SequenceParallelLayerNorm,
    VocabParallelCECache,
    VocabParallelHead,
    VocabParallelHeadCache,
    check_divisible,
    plan,
    sequence_parallel_saving,
    tensor_plan,
    tp_comm_bytes,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_backward,
)
