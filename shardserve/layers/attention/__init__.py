from shardserve.layers.attention.backend import AttentionBackend, AttentionSpec, CommonAttentionMetadata
from shardserve.layers.attention.layer import Attention, AttentionContext
from shardserve.layers.attention.torch_ref import TorchAttentionBackend

__all__ = ["Attention", "AttentionBackend", "AttentionContext", "AttentionSpec", "CommonAttentionMetadata",
           "TorchAttentionBackend"]
