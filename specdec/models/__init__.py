"""Model core: a Llama-family decoder over a ragged batch and a paged KV cache."""

from specdec.models.config import ModelConfig
from specdec.models.kv_cache import AttentionMetadata, KVCacheFull, PagedKVCache
from specdec.models.llama import ForwardOutput, LlamaForCausalLM
from specdec.models.loader import load_model, parse_dtype, save_model

__all__ = [
    "AttentionMetadata", "ForwardOutput", "KVCacheFull", "LlamaForCausalLM", "ModelConfig",
    "PagedKVCache", "load_model", "parse_dtype", "save_model",
]
