"""DeepSeek-V4 model plugin: config, model, HF bridge, incremental decoding."""

from .config import ConfigError, DeepSeekV4Config
from .model import CausalLMOutput, DeepSeekV4ForCausalLM, KVCache

__all__ = ["ConfigError", "DeepSeekV4Config", "DeepSeekV4ForCausalLM", "CausalLMOutput", "KVCache"]
