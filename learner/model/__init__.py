"""The model layer: the transformer (Flax NNX), LoRA adapters, parameter init, paths, sharding rules, precision.

`learner.model` re-exports `learner.model.transformer`; the other modules are imported by name
(`learner.model.lora`, `learner.model.sharding`, ...).
"""

from learner.model.transformer import Attention
from learner.model.transformer import Block
from learner.model.transformer import KVCache
from learner.model.transformer import LayerKVCache
from learner.model.transformer import Llama3RopeScaling
from learner.model.transformer import MLP
from learner.model.transformer import ModelConfig
from learner.model.transformer import Projection
from learner.model.transformer import RMSNorm
from learner.model.transformer import Transformer
from learner.model.transformer import apply_rope
from learner.model.transformer import cast_model
from learner.model.transformer import count_params
from learner.model.transformer import model_config
from learner.model.transformer import output_head
from learner.model.transformer import place_window
from learner.model.transformer import rope_frequencies
from learner.model.transformer import take_columns
from learner.model.transformer import take_window
from learner.model.transformer import token_embedding

__all__ = [
    "Attention",
    "Block",
    "KVCache",
    "LayerKVCache",
    "Llama3RopeScaling",
    "MLP",
    "ModelConfig",
    "Projection",
    "RMSNorm",
    "Transformer",
    "apply_rope",
    "cast_model",
    "count_params",
    "model_config",
    "output_head",
    "place_window",
    "rope_frequencies",
    "take_columns",
    "take_window",
    "token_embedding",
]
