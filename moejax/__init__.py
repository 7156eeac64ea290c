"""moejax: a Mixture-of-Experts layer for LLM inference in JAX, exact to the major MoE model families."""

from moejax import dispatch, hf, lora, parallel, sharding
from moejax.config import (
    FAMILIES,
    Activation,
    ClampOrder,
    MoEConfig,
    ScalingTarget,
    ScoreOrder,
    Scoring,
    SharedExpert,
)
from moejax.forward import IMPLS, MoEOutput, checked_moe_forward, chosen_impl, moe_forward
from moejax.layer import LoRAParam, MoE
from moejax.params import ExpertWeights, MoEParams, RouterParams, SharedParams, init_params
from moejax.quantized import dequantize, quantize
from moejax.routing import Routing, route
from moejax.stats import MoEStats

__all__ = [
    "FAMILIES",
    "IMPLS",
    "Activation",
    "ClampOrder",
    "ExpertWeights",
    "LoRAParam",
    "MoE",
    "MoEConfig",
    "MoEOutput",
    "MoEParams",
    "MoEStats",
    "RouterParams",
    "Routing",
    "ScalingTarget",
    "ScoreOrder",
    "Scoring",
    "SharedExpert",
    "SharedParams",
    "checked_moe_forward",
    "chosen_impl",
    "dequantize",
    "dispatch",
    "hf",
    "init_params",
    "lora",
    "moe_forward",
    "parallel",
    "quantize",
    "route",
    "sharding",
]
__version__ = "0.1.0"
