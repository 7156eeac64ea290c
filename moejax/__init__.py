"""moejax: a Mixture-of-Experts layer for LLM inference in JAX, exact to the major MoE model families."""

from moejax import hf, lora
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
from moejax.forward import IMPLS, checked_moe_forward, moe_forward
from moejax.layer import LoRAParam, MoE
from moejax.lora import LoRAParams
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
    "LoRAParams",
    "MoE",
    "MoEConfig",
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
    "dequantize",
    "hf",
    "init_params",
    "lora",
    "moe_forward",
    "quantize",
    "route",
]
__version__ = "0.1.0"
