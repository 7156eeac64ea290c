"""A Qwen3-MoE decoder in plain JAX around `moejax.moe_forward`, loaded from a Hugging Face checkpoint directory.

    cfg, params = qwen3_moe.load("path/to/checkpoint")            # config.json + safetensors, as transformers saves
    tokens = qwen3_moe.generate(params, prompt, cfg, steps=16)    # [B, steps] greedy, one jitted program

The model is the one transformers' `Qwen3MoeForCausalLM` computes: token embedding; per decoder layer
`h += attn(rmsnorm(h))` (q/k/v projections, a per-head RMSNorm of q and k, rotary embedding over the whole head,
grouped-query attention over a KV cache, o projection) and `h += mlp(rmsnorm(h))` (the MoE block, or a dense
SwiGLU MLP on `mlp_only_layers`); a final RMSNorm and the lm_head. The MoE blocks are read by `moejax.hf.load_layers`
and run by `moejax.moe_forward` with the `impl` and `dispatch` given (expert parallelism:
`moejax.dispatch.expert_parallel`, the experts placed by `moejax.sharding.shard_params`); the rest is read here.

Shapes: B batch, T tokens of a chunk, S the cache's positions, H hidden, N query heads, G key/value heads, D head
dim, V vocabulary. Activations are float32 unless the checkpoint is loaded in another dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from moejax.config import MoEConfig
from moejax.dispatch import Dispatch
from moejax.hf import files
from moejax.params import MoEParams

Array = jax.Array
MODEL_TYPE = "qwen3_moe"


@dataclasses.dataclass(frozen=True)
class Config:
    """The decoder's sizes (static: hashable), read from config.json by `config_from_hf`.

    `moe`: the MoE block's config, the same for every MoE layer (`moejax.hf.config_from_hf`); `moe_layers`: the
    decoder layers that hold an MoE block, the others a dense MLP of width `intermediate_size`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    moe: MoEConfig
    moe_layers: tuple[int, ...]

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding pairs its halves)")
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(f"the MoE block's hidden_size={self.moe.hidden_size} is not {self.hidden_size}")


def config_from_hf(hf_config: dict, where: str = "config") -> Config:
    """The `Config` of a transformers Qwen3-MoE config dict (config.json). `ValueError` naming `where` and the field
    for another model type or a field that is missing; `NotImplementedError` for a rope scaling other than default."""
    if hf_config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{where}: model_type={hf_config.get('model_type')!r}, this model reads {MODEL_TYPE!r}")

    def field(name, default=None):
        value = hf_config.get(name, default)
        if value is None:
            raise ValueError(f"{where}: no {name!r}")
        return value

    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"{where}: rope_type={rope_type!r}; this example implements the default rotary")
    hidden, heads = field("hidden_size"), field("num_attention_heads")
    return Config(
        vocab_size=field("vocab_size"),
        hidden_size=hidden,
        num_layers=field("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=field("num_key_value_heads", heads),
        head_dim=field("head_dim", hidden // heads),
        intermediate_size=field("intermediate_size"),
        rms_norm_eps=float(field("rms_norm_eps")),
        rope_theta=float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        moe=moejax.hf.config_from_hf(hf_config),
        moe_layers=tuple(moejax.hf.moe_layer_indices(hf_config)),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Attention:
    q: Array  # [H, N*D]  (transformers' q_proj.weight transposed: x @ q)
    k: Array  # [H, G*D]
    v: Array  # [H, G*D]
    o: Array  # [N*D, H]
    q_norm: Array  # [D]
    k_norm: Array  # [D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseMLP:
    gate: Array  # [H, I]
    up: Array  # [H, I]
    down: Array  # [I, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    input_norm: Array  # [H]
    attn: Attention
    post_norm: Array  # [H]
    mlp: MoEParams | DenseMLP


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    embed: Array  # [V, H]
    layers: tuple[Layer, ...]
    norm: Array  # [H]
    lm_head: Array  # [H, V]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Each layer's keys and values: one `[B, S, G, D]` array per layer, written in place at each chunk's
    positions (a stacked `[L, ...]` cache would be copied whole by every step's update)."""

    k: tuple[Array, ...]  # L x [B, S, G, D]
    v: tuple[Array, ...]  # L x [B, S, G, D]

    @classmethod
    def zeros(cls, cfg: Config, batch: int, length: int, like: Array | None = None) -> KVCache:
        """An empty cache of `length` positions, in the dtype of `like` (the embedding; float32 without it) and
        replicated on its mesh: with parameters placed on a mesh of Explicit axes, every activation is typed on
        that mesh, and the cache's updates need the same type."""
        shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
        dtype = jnp.float32 if like is None else like.dtype
        sharding = None if like is None else jax.typeof(like).sharding.update(spec=jax.sharding.PartitionSpec())
        zeros = tuple(jnp.zeros(shape, dtype, out_sharding=sharding) for _ in range(cfg.num_layers))
        return cls(zeros, zeros)


# -- loading ---------------------------------------------------------------------------------------------------


def load(checkpoint: str | os.PathLike, *, dtype=None, layout: str = "auto") -> tuple[Config, Params]:
    """`(Config, Params)` of a Qwen3-MoE checkpoint directory (config.json + safetensors, one file or shards).

    The MoE blocks come from `moejax.hf.load_layers` (with `dtype` and the experts' `layout`), every other tensor
    from the safetensors files here, transposed to `[in, out]`. Raises `ValueError` naming the file and key for a
    missing tensor or one of the wrong shape."""
    path = os.fspath(checkpoint)
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{path} has no config.json: expected a checkpoint directory as save_pretrained writes it")
    cfg = config_from_hf(files.read_json(config_path, "config"), config_path)
    moe = moejax.hf.load_layers(path, list(cfg.moe_layers), dtype=dtype, layout=layout)
    H, N, G, D, V = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
        a = p + "self_attn."
        shapes |= {a + "q_proj.weight": (N * D, H), a + "k_proj.weight": (G * D, H), a + "v_proj.weight": (G * D, H)}
        shapes |= {a + "o_proj.weight": (H, N * D), a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)}
        if i not in moe:
            I = cfg.intermediate_size
            m = p + "mlp."
            shapes |= {m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H), m + "down_proj.weight": (H, I)}
    t = _read(path, shapes)
    cast = (lambda a: a) if dtype is None else (lambda a: a.astype(dtype))
    w = lambda key: jnp.asarray(cast(t[key]))
    linear = lambda key: jnp.asarray(cast(t[key].T))  # [out, in] -> [in, out]
    layers = []
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        attn = Attention(
            *(linear(a + f"{n}_proj.weight") for n in "qkvo"), w(a + "q_norm.weight"), w(a + "k_norm.weight")
        )
        mlp = moe[i][1] if i in moe else DenseMLP(*(linear(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up", "down")))
        layers.append(Layer(w(p + "input_layernorm.weight"), attn, w(p + "post_attention_layernorm.weight"), mlp))
    embed = w("model.embed_tokens.weight")
    lm_head = embed.T if cfg.tie_word_embeddings else linear("lm_head.weight")
    return cfg, Params(embed, tuple(layers), w("model.norm.weight"), lm_head)


def _read(path: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The tensors `shapes` names, each checked against its shape (`ValueError` naming the file and key)."""
    weight_map = files.weight_map(path)
    missing = [key for key in shapes if key not in weight_map]
    if missing:
        raise ValueError(f"{path}: no tensor {missing[0]!r} ({len(missing)} missing)")
    grouped = files.by_file(weight_map, shapes)
    files.check_files_exist(grouped, path)
    tensors = {}
    for file, keys in grouped.items():
        for key, value in files.read_file(file, keys).items():
            if value.shape != shapes[key]:
                raise ValueError(f"{file}: tensor {key!r} has shape {value.shape}, expected {shapes[key]}")
            tensors[key] = value
    return tensors


def shard(params: Params, cfg: Config, mesh: jax.sharding.Mesh, expert_axis: str = "expert") -> Params:
    """`params` placed for expert parallelism over `expert_axis` of `mesh`: each MoE block's experts split
    (`moejax.sharding.shard_params`), everything else replicated. Run with
    `dispatch=moejax.dispatch.expert_parallel("replicated", mesh)` (decode) or `"all_to_all"` (long prompts)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    place = lambda tree: jax.device_put(tree, replicated)
    layers = []
    for layer in params.layers:
        if isinstance(layer.mlp, MoEParams):
            mlp = moejax.sharding.shard_params(layer.mlp, cfg.moe, mesh, expert_axis=expert_axis)
        else:
            mlp = place(layer.mlp)
        layers.append(dataclasses.replace(place(dataclasses.replace(layer, mlp=None)), mlp=mlp))
    return dataclasses.replace(place(dataclasses.replace(params, layers=())), layers=tuple(layers))


# -- the model -------------------------------------------------------------------------------------------------


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """`x / rms(x) · w` over the last axis, in float32 (transformers' Qwen3MoeRMSNorm), in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rotary(x: Array, positions: Array, theta: float) -> Array:
    """The default rotary embedding of `x [B, T, heads, D]` at `positions [T]`: the halves of each head rotated
    together (transformers' `rotate_half`), angles `position / theta^(2j/D)`."""
    D = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D)  # [D/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[None, :, None]  # [1, T, 1, D]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[None, :, None]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def attention(p: Attention, x: Array, k_cache: Array, v_cache: Array, pos: Array, cfg: Config):
    """Causal grouped-query attention of `x [B, T, H]` at positions `pos..pos+T-1`, the chunk's keys and values
    written into the layer's cache `[B, S, G, D]` first. Returns `(y [B, T, H], k_cache, v_cache)`."""
    B, T, _ = x.shape
    N, G, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    positions = pos + jnp.arange(T)
    q = rms_norm((x @ p.q).reshape(B, T, N, D), p.q_norm, cfg.rms_norm_eps)
    k = rms_norm((x @ p.k).reshape(B, T, G, D), p.k_norm, cfg.rms_norm_eps)
    q, k = rotary(q, positions, cfg.rope_theta), rotary(k, positions, cfg.rope_theta)
    v = (x @ p.v).reshape(B, T, G, D)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, pos, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, pos, 0, 0))
    q = q.reshape(B, T, G, N // G, D)  # each key/value head serves N/G query heads
    scores = jnp.einsum("btgnd,bsgd->bgnts", q, k_cache, preferred_element_type=jnp.float32) * D**-0.5
    visible = jnp.arange(k_cache.shape[1])[None, :] <= positions[:, None]  # [T, S]: causal, written positions only
    scores = jnp.where(visible, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bgnts,bsgd->btgnd", weights, v_cache).reshape(B, T, N * D)
    return out.astype(x.dtype) @ p.o, k_cache, v_cache


def forward(
    params: Params,
    tokens: Array,
    cache: KVCache,
    pos: Array,
    cfg: Config,
    *,
    impl: str = "auto",
    dispatch: Dispatch | None = None,
    return_routing: bool = False,
):
    """Logits `[B, T, V]` float32 of `tokens [B, T]` at positions `pos..pos+T-1` (int, may be traced), and the
    cache with the chunk written. A token id outside [0, V) gives NaN logits for its row (inside jit nothing can
    raise), never another token's. With `return_routing`, also each MoE layer's expert ids `[L_moe, B, T, K]`.

    `impl` and `dispatch` are passed to every `moejax.moe_forward` call."""
    # An id outside [0, V) reads a row of NaN, never another token's row.
    h = params.embed.at[tokens].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)  # [B, T, H]
    ks, vs, chosen = [], [], []
    for i, layer in enumerate(params.layers):
        with jax.named_scope(f"layer_{i}"):
            y, k, v = attention(
                layer.attn, rms_norm(h, layer.input_norm, cfg.rms_norm_eps), cache.k[i], cache.v[i], pos, cfg
            )
            h = h + y
            ks.append(k)
            vs.append(v)
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            if isinstance(layer.mlp, DenseMLP):
                h = h + (jax.nn.silu(x @ layer.mlp.gate) * (x @ layer.mlp.up)) @ layer.mlp.down
                continue
            out = moejax.moe_forward(layer.mlp, x, cfg.moe, impl=impl, dispatch=dispatch, return_routing=return_routing)
            if return_routing:
                chosen.append(out.routing.indices.reshape(*x.shape[:2], -1))
                out = out.y
            h = h + out
    h = rms_norm(h, params.norm, cfg.rms_norm_eps)
    logits = jnp.dot(h, params.lm_head, preferred_element_type=jnp.float32)
    cache = KVCache(tuple(ks), tuple(vs))
    return (logits, cache, jnp.stack(chosen)) if return_routing else (logits, cache)


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "impl", "dispatch", "return_routing"))
def generate(
    params: Params,
    prompt: Array,
    cfg: Config,
    steps: int,
    *,
    impl: str = "auto",
    dispatch: Dispatch | None = None,
    return_routing: bool = False,
):
    """Greedy generation: `steps` new tokens `[B, steps]` int32 after `prompt [B, P]`, as one jitted program.

    1. The prompt in one forward call (its keys and values into a cache of P + steps positions), the first token
       its last position's argmax.  2. `steps - 1` decode steps in one `jax.lax.scan`, each one token per row
       through the whole model with the cache.
    With `return_routing`, also each decode step's expert ids `[steps - 1, L_moe, B, K]` (the prompt's excluded).
    """
    if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt must be [B, P] integer token ids with P >= 1, got {prompt.shape} {prompt.dtype}")
    B, P = prompt.shape
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    cache = KVCache.zeros(cfg, B, P + steps, params.embed)
    logits, cache, *_ = forward(params, prompt, cache, 0, cfg, impl=impl, dispatch=dispatch)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    def step(carry, i):
        token, cache = carry
        out = forward(
            params, token[:, None], cache, P + i, cfg, impl=impl, dispatch=dispatch, return_routing=return_routing
        )
        logits, cache = out[:2]
        following = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (following, cache), (following, out[2][:, :, 0] if return_routing else None)

    _, (tokens, routing) = jax.lax.scan(step, (first, cache), jnp.arange(steps - 1))
    tokens = jnp.concatenate([first[:, None], tokens.T], axis=1)
    return (tokens, routing) if return_routing else tokens


# -- a random checkpoint ---------------------------------------------------------------------------------------


def write_random_checkpoint(
    path: str | os.PathLike,
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_experts: int = 16,
    top_k: int = 4,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (),
    seed: int = 0,
) -> None:
    """Write a random Qwen3-MoE checkpoint to directory `path` in the layout transformers' `save_pretrained` writes
    (config.json, model.safetensors; per-expert keys, `[out, in]` weights), float32; the layers `mlp_only_layers`
    hold a dense MLP of width 4·H instead of an MoE block. The weights are
    `N(0, 1/sqrt(fan_in))` (norms around 1) so that activations keep their scale through the layers and the
    logits of different tokens are well apart (greedy tokens are then stable under float32 rounding)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    H, N, G, D, V, E, I = hidden_size, num_heads, num_kv_heads, head_dim, vocab_size, num_experts, moe_intermediate_size
    linear = lambda out, n_in: (rng.standard_normal((out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    t = {"model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)}
        a = p + "self_attn."
        t |= {a + "q_proj.weight": linear(N * D, H), a + "k_proj.weight": linear(G * D, H)}
        t |= {a + "v_proj.weight": linear(G * D, H), a + "o_proj.weight": linear(H, N * D)}
        t |= {a + "q_norm.weight": norm(D), a + "k_norm.weight": norm(D)}
        if i in mlp_only_layers:
            m = p + "mlp."
            t |= {m + "gate_proj.weight": linear(4 * H, H), m + "up_proj.weight": linear(4 * H, H)}
            t[m + "down_proj.weight"] = linear(H, 4 * H)
            continue
        t[p + "mlp.gate.weight"] = linear(E, H) * 4.0  # a router with clear preferences
        for e in range(E):
            x = f"{p}mlp.experts.{e}."
            t |= {x + "gate_proj.weight": linear(I, H), x + "up_proj.weight": linear(I, H)}
            t[x + "down_proj.weight"] = linear(H, I)
    t["model.norm.weight"] = norm(H)
    t["lm_head.weight"] = linear(V, H) * 4.0
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": V,
        "hidden_size": H,
        "intermediate_size": 4 * H,
        "num_hidden_layers": num_layers,
        "num_attention_heads": N,
        "num_key_value_heads": G,
        "head_dim": D,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": sorted(mlp_only_layers),
        "num_experts": E,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": I,
        "norm_topk_prob": norm_topk_prob,
        "dtype": "float32",
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
