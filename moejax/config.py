"""`MoEConfig`: one frozen, validated description of an MoE block, able to express every family in docs/FAMILIES.md.

The config says *what* the block computes (routing math, expert math, shared expert); it never says how
(backend, block sizes) and never knows about sharding. Presets per family are classmethods on `MoEConfig`
(`MoEConfig.preset("deepseek_v3", hidden_size=..., ...)`); `moejax.hf.config_from_hf` builds one from a
Hugging Face config.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import Any, Literal


class Scoring(enum.Enum):
    """How router logits become scores."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    SQRT_SOFTPLUS = "sqrtsoftplus"


class ScoreOrder(enum.Enum):
    """Whether scores are computed over all experts before top-k, or over the k selected logits after it.

    BEFORE_TOPK: scores over E (+ zero experts), top-k of the (biased, group-masked) scores. Most families.
    AFTER_TOPK: top-k of the raw logits, then the score function over the k selected values only
    (gpt-oss: softmax over the k logits; Llama-4: sigmoid of each selected logit).
    """

    BEFORE_TOPK = "before_topk"
    AFTER_TOPK = "after_topk"


class Activation(enum.Enum):
    """The expert's gated activation `h = f(gate, up)`."""

    SILU = "silu"  # silu(gate) * up
    GELU_TANH = "gelu_pytorch_tanh"  # gelu_tanh(gate) * up
    GPT_OSS = "gpt_oss"  # (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)


class ClampOrder(enum.Enum):
    """Where a clamped SwiGLU applies its upper limit on the gate side (the up side is always clamp(up, ±L))."""

    BEFORE_ACTIVATION = "before_activation"  # DeepSeek-V4: silu(min(gate, L)) * clamp(up, ±L)
    AFTER_ACTIVATION = "after_activation"  # Step-3.7:    min(silu(gate), L) * clamp(up, ±L)


class SharedExpert(enum.Enum):
    """The always-on shared expert added to the routed sum."""

    NONE = "none"
    UNGATED = "ungated"  # out = routed + shared(x)
    SIGMOID_GATED = "sigmoid_gated"  # out = routed + sigmoid(x . w_gate) * shared(x)


class ScalingTarget(enum.Enum):
    """Where `routed_scaling_factor` is applied (mathematically equal, numerically not)."""

    WEIGHTS = "weights"  # w *= factor (DeepSeek-V3/V4, LongCat, GLM)
    OUTPUT = "output"  # routed_sum *= factor (Step-3.7)


DtypePolicy = Literal["float32", "input"]
FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v3",
    "glm4_moe",
    "glm_moe_dsa",
    "minimax_m2",
    "step3p7",
    "longcat_flash",
    "deepseek_v4",
    "gemma4",
    "gpt_oss",
    "llama4",
    "olmoe",
)


def _enum(value: Any, cls: type[enum.Enum], name: str) -> enum.Enum:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = [m.value for m in cls]
        raise ValueError(f"MoEConfig.{name}={value!r} is not one of {allowed}") from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    """The math of one MoE block. Shapes: H=hidden_size, E=num_experts, K=top_k, I=intermediate_size.

    Routing (see `moejax.routing.route` for the order of operations):
      scoring, score_order: score function and whether it runs before or after top-k.
      correction_bias: add a per-expert bias to the scores for *selection only* (DeepSeek-V3 style).
      router_bias: a bias on the router logits themselves (gpt-oss).
      n_group, topk_group: group-limited selection (group score = sum of its top-2 biased scores; the
        experts of the other groups are masked with -inf).
      normalize, norm_epsilon: renormalise the k weights, `w / (sum(w) + norm_epsilon)`.
      routed_scaling_factor, scaling_target: multiply the weights or the routed sum by a constant.
      per_expert_scale: multiply each weight by a learned per-expert scale (Gemma-4).
      router_prenorm: the router sees `rmsnorm(x) * scale / sqrt(H)` (Gemma-4), with `rms_norm_eps`.
      rms_norm_eps: the epsilon of the RMSNorms of `router_prenorm` and `expert_prenorm` (needed by them, None
        without them: a config never holds an epsilon its math does not use).
      num_zero_experts: LongCat's zero-computation experts: ids E..E+Z-1 return their input (`w * x`).
      hash_routing, vocab_size: expert ids come from a `[vocab_size, K]` table indexed by token id
        (DeepSeek-V4 hash layers); the weights are still the router's scores of those experts.
      weights_on_input: the routing weight scales the expert *input* instead of its output (Llama-4).
      router_dtype: dtype the logits are rounded to ("float32" or the input's dtype; accumulation is float32).
      score_dtype: dtype the scores are rounded to before selection (DeepSeek-V4 scores in the model dtype).
      weights_dtype: routing weights are rounded to this dtype before use ("float32" or the input's dtype,
        as the Qwen family, DeepSeek-V4, gpt-oss and Llama-4 do in a bf16 model).
    Experts:
      activation, swiglu_limit, clamp_order, swiglu_alpha: the gated activation; a limit of None is no clamp.
      expert_bias: biases on gate/up/down (gpt-oss).
      expert_prenorm: experts see `rmsnorm(x) * w` (Gemma-4's pre_feedforward_layernorm_2).
    Shared expert:
      shared_expert, shared_intermediate_size, shared_swiglu_limit (None: no clamp).
    """

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    # routing
    scoring: Scoring = Scoring.SOFTMAX
    score_order: ScoreOrder = ScoreOrder.BEFORE_TOPK
    correction_bias: bool = False
    router_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = False
    norm_epsilon: float = 0.0
    routed_scaling_factor: float = 1.0
    scaling_target: ScalingTarget = ScalingTarget.WEIGHTS
    per_expert_scale: bool = False
    router_prenorm: bool = False
    rms_norm_eps: float | None = None
    num_zero_experts: int = 0
    hash_routing: bool = False
    vocab_size: int | None = None
    weights_on_input: bool = False
    router_dtype: DtypePolicy = "float32"
    score_dtype: DtypePolicy = "float32"
    weights_dtype: DtypePolicy = "float32"
    # experts
    activation: Activation = Activation.SILU
    swiglu_limit: float | None = None
    clamp_order: ClampOrder = ClampOrder.BEFORE_ACTIVATION
    swiglu_alpha: float = 1.702
    expert_bias: bool = False
    expert_prenorm: bool = False
    # shared expert
    shared_expert: SharedExpert = SharedExpert.NONE
    shared_intermediate_size: int = 0
    shared_swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        for name, cls in (
            ("scoring", Scoring),
            ("score_order", ScoreOrder),
            ("scaling_target", ScalingTarget),
            ("activation", Activation),
            ("clamp_order", ClampOrder),
            ("shared_expert", SharedExpert),
        ):
            object.__setattr__(self, name, _enum(getattr(self, name), cls, name))
        for field in dataclasses.fields(self):  # numpy scalars (np.int64 sizes, np.float32 eps) as Python numbers
            value = getattr(self, field.name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, field.name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
                object.__setattr__(self, field.name, float(value))
        self._validate()

    # -- validation -------------------------------------------------------------------------------------
    def _validate(self) -> None:
        def fail(field: str, msg: str) -> None:
            raise ValueError(f"MoEConfig.{field}={getattr(self, field)!r}: {msg}")

        for field in ("hidden_size", "num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(field, "must be a positive int")
        if isinstance(self.num_zero_experts, bool) or not isinstance(self.num_zero_experts, int):
            fail("num_zero_experts", "must be an int >= 0")
        if self.num_zero_experts < 0:
            fail("num_zero_experts", "must be >= 0")
        if self.top_k > self.num_selectable:
            fail("top_k", f"must be <= num_experts + num_zero_experts = {self.num_selectable}")
        if self.num_selectable % self.n_group:
            fail("n_group", f"must divide the number of selectable experts ({self.num_selectable})")
        if self.n_group > 1 and self.num_selectable // self.n_group < 2:
            fail("n_group", "each group needs >= 2 experts (the group score is the sum of its top 2)")
        if self.topk_group > self.n_group:
            fail("topk_group", f"must be <= n_group={self.n_group}")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_selectable // self.n_group):
            fail("top_k", "must be <= topk_group * experts per group, or selection would pick masked experts")
        if self.norm_epsilon < 0 or not math.isfinite(self.norm_epsilon):
            fail("norm_epsilon", "must be a finite float >= 0")
        if not math.isfinite(self.routed_scaling_factor):
            fail("routed_scaling_factor", "must be finite")
        prenorm = self.router_prenorm or self.expert_prenorm
        if prenorm and self.rms_norm_eps is None:
            fail("rms_norm_eps", "router_prenorm / expert_prenorm need their RMSNorm's epsilon")
        if not prenorm and self.rms_norm_eps is not None:
            fail("rms_norm_eps", "only router_prenorm / expert_prenorm read it: leave it None")
        if prenorm and not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            fail("rms_norm_eps", "must be a finite float > 0")
        if not math.isfinite(self.swiglu_alpha):
            fail("swiglu_alpha", "must be finite")
        for field in ("router_dtype", "score_dtype", "weights_dtype"):
            if getattr(self, field) not in ("float32", "input"):
                fail(field, "must be 'float32' or 'input'")
        if self.score_order is ScoreOrder.AFTER_TOPK:
            if self.scoring is Scoring.SQRT_SOFTPLUS:
                fail("scoring", "score_order='after_topk' supports 'softmax' (gpt-oss) or 'sigmoid' (Llama-4)")
            for field in ("correction_bias", "normalize", "per_expert_scale", "hash_routing"):
                if getattr(self, field):
                    fail(field, "is not supported with score_order='after_topk'")
            if self.n_group > 1:
                fail("n_group", "group-limited selection needs score_order='before_topk'")
            if self.num_zero_experts:
                fail("num_zero_experts", "zero experts need score_order='before_topk'")
        if self.hash_routing:
            if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
                fail("vocab_size", "hash_routing needs vocab_size >= 1 (rows of the token-id table)")
            if self.n_group > 1:
                fail("n_group", "hash routing has no group-limited selection")
            if self.weights_on_input:
                # A table row may name one expert twice; input-scaled slots of one expert then have no single
                # meaning (E((w1+w2)·x) or E(w1·x)+E(w2·x)) and no family combines the two.
                fail("weights_on_input", "is not supported with hash_routing=True (no family combines them)")
        elif self.vocab_size is not None:
            fail("vocab_size", "is only used with hash_routing=True; leave it None")
        if self.weights_on_input and (self.expert_bias or self.num_zero_experts):
            fail("weights_on_input", "needs experts without biases and without zero experts (Llama-4 form)")
        for field in ("swiglu_limit", "shared_swiglu_limit"):
            limit = getattr(self, field)
            if limit is not None and not (limit > 0 and math.isfinite(limit)):
                fail(field, "must be None (no clamp) or a finite float > 0")
        if self.activation is Activation.GPT_OSS and self.swiglu_limit is None:
            fail("swiglu_limit", "activation='gpt_oss' needs a limit (7.0 in gpt-oss)")
        if self.shared_expert is SharedExpert.NONE:
            if self.shared_intermediate_size:
                fail("shared_intermediate_size", "must be 0 when shared_expert='none'")
            if self.shared_swiglu_limit is not None:
                fail("shared_swiglu_limit", "must be None when shared_expert='none'")
        elif self.shared_intermediate_size < 1:
            fail("shared_intermediate_size", f"must be >= 1 with shared_expert={self.shared_expert.value!r}")

    # -- derived ----------------------------------------------------------------------------------------
    @property
    def num_selectable(self) -> int:
        """Routed experts plus zero-computation experts: the width of the router."""
        return self.num_experts + self.num_zero_experts

    def replace(self, **changes: Any) -> MoEConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, family: str, **overrides: Any) -> MoEConfig:
        """The block semantics of `family` (see docs/FAMILIES.md) at small default sizes; sizes via overrides.

        >>> MoEConfig.preset("deepseek_v3", hidden_size=7168, num_experts=256, intermediate_size=2048)
        """
        if family not in _PRESETS:
            raise ValueError(f"unknown family {family!r}; known families: {', '.join(FAMILIES)}")
        fields = {"hidden_size": 64, "intermediate_size": 32, **_PRESETS[family]}
        fields.update(overrides)
        return cls(**fields)


_SHARED_GATED = {"shared_expert": SharedExpert.SIGMOID_GATED, "shared_intermediate_size": 48}
_QWEN = {"num_experts": 16, "top_k": 4, "router_dtype": "input", "weights_dtype": "input"}
_DEEPSEEK = {
    "scoring": Scoring.SIGMOID,
    "correction_bias": True,
    "normalize": True,
    "norm_epsilon": 1e-20,
    "shared_expert": SharedExpert.UNGATED,
    "shared_intermediate_size": 32,
}
_MINIMAX = {
    "num_experts": 16,
    "top_k": 4,
    "scoring": Scoring.SIGMOID,
    "correction_bias": True,
    "normalize": True,
    "router_dtype": "input",
}

# Small-size presets with each family's semantics; `config_from_hf` sets real sizes from a checkpoint config.
_PRESETS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_experts": 8, "top_k": 2, "normalize": True, "router_dtype": "input"},
    "qwen2_moe": {**_QWEN, **_SHARED_GATED},
    "qwen3_moe": _QWEN,  # HF default norm_topk_prob=False; the released 30B/235B configs set it
    "qwen3_next": {**_QWEN, "normalize": True, **_SHARED_GATED},
    "qwen3_5_moe": {**_QWEN, "normalize": True, **_SHARED_GATED},
    "deepseek_v3": {
        **_DEEPSEEK,
        "num_experts": 32,
        "top_k": 4,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
    },
    "glm4_moe": {**_DEEPSEEK, "num_experts": 16, "top_k": 4},  # HF default 1.0; released configs use 2.5
    "glm_moe_dsa": {**_DEEPSEEK, "num_experts": 16, "top_k": 4, "routed_scaling_factor": 2.5},
    "minimax_m2": _MINIMAX,
    "step3p7": {
        **_MINIMAX,
        "scaling_target": ScalingTarget.OUTPUT,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 7.0,
        "clamp_order": ClampOrder.AFTER_ACTIVATION,
        "shared_expert": SharedExpert.UNGATED,
        "shared_intermediate_size": 48,
        "shared_swiglu_limit": 16.0,
    },
    "longcat_flash": {
        "num_experts": 12,
        "num_zero_experts": 4,
        "top_k": 4,
        "correction_bias": True,
        "routed_scaling_factor": 6.0,
    },
    "deepseek_v4": {
        "num_experts": 16,
        "top_k": 4,
        "scoring": Scoring.SQRT_SOFTPLUS,
        "correction_bias": True,
        "normalize": True,
        "norm_epsilon": 1e-20,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "clamp_order": ClampOrder.BEFORE_ACTIVATION,
        "shared_expert": SharedExpert.UNGATED,
        "shared_intermediate_size": 32,
        "shared_swiglu_limit": 10.0,
        "router_dtype": "input",
        "score_dtype": "input",
        "weights_dtype": "input",
    },
    "gemma4": {
        "num_experts": 16,
        "top_k": 4,
        "normalize": True,
        "per_expert_scale": True,
        "router_prenorm": True,
        "expert_prenorm": True,
        "rms_norm_eps": 1e-6,  # Gemma4TextConfig's default
        "activation": Activation.GELU_TANH,
        "router_dtype": "input",
    },
    "gpt_oss": {
        "num_experts": 16,
        "top_k": 4,
        "score_order": ScoreOrder.AFTER_TOPK,
        "router_bias": True,
        "activation": Activation.GPT_OSS,
        "swiglu_limit": 7.0,
        "expert_bias": True,
        "router_dtype": "input",
        "weights_dtype": "input",
    },
    "llama4": {
        "num_experts": 16,
        "top_k": 1,
        "scoring": Scoring.SIGMOID,
        "score_order": ScoreOrder.AFTER_TOPK,
        "weights_on_input": True,
        "shared_expert": SharedExpert.UNGATED,
        "shared_intermediate_size": 32,
        "router_dtype": "input",
        "weights_dtype": "input",
    },
    "olmoe": _QWEN,
}
assert set(_PRESETS) == set(FAMILIES)
