"""qwen-triton: a Qwen3.5 inference engine in which every operator is a hand-written Triton kernel."""

from .config import ConfigError, ModelConfig, load_config
from .engine.llm import LLM, Generation
from .weights import WeightError

__all__ = ["LLM", "Generation", "ModelConfig", "ConfigError", "WeightError", "load_config"]
__version__ = "0.1.0"
