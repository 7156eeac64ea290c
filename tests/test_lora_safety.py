"""Adapters isolated per row, and hostile adapter inputs.

* Adapter ids of any integer type clamp to 0 (no adapter) without wrapping on every path (one device, data-parallel
  rows, EP "replicated" and "all_to_all", the nnx layer), and `checked_moe_forward` raises for them.
* One adapter holding inf / NaN leaves the rows of the other adapters and of id 0 bit for bit as they are without it,
  in both forms of the row delta (decode gather, prefill select) on every XLA/CPU plan.
* PEFT files moejax cannot apply (PiSSA-like initialisations) or cannot read (malformed config, bad regex, rank 0)
  are refused with errors naming the file, field or target; peft's defaults for a missing r / lora_alpha.
* A `LoRAPair` with a Python float or numpy scalar scale is accepted.

One small config (qwen2_moe: every target, with a sigmoid-gated shared expert); programs are traced with the adapters
as arguments, so the clean and the poisoned stack share one compiled program.
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multihost_worker import numpy_params

import moejax
from moejax import hf, parallel, sharding
from moejax.lora import LoRAPair, LoRAParams, _target_shapes, from_pairs, pair_delta, stack
from moejax.weights import to_layout

safetensors_numpy = pytest.importorskip("safetensors.numpy")

CFG = moejax.MoEConfig.preset(
    "qwen2_moe", num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, shared_intermediate_size=8
)
PLANS = ("xla_decode", "xla_grouped", "cpu_decode", "cpu_grouped")
WIDE = 2**32 + 1  # wraps to adapter 1 in an int32 cast


def _adapter(seed: int, rank: int = 2, poison: str | None = None) -> LoRAParams:
    """A random adapter on every target; `poison` puts inf in every B ("b") or NaN in every A ("a")."""
    rng = np.random.default_rng(seed)
    pairs = {}
    for name, (lead, n_in, n_out) in _target_shapes(CFG).items():
        a = rng.standard_normal((*lead, rank, n_in)).astype(np.float32) / np.sqrt(n_in)
        b = rng.standard_normal((*lead, n_out, rank)).astype(np.float32)
        if poison == "a":
            a[..., 0, :] = np.nan
        if poison == "b":
            b[..., 0] = np.inf
        pairs[name] = LoRAPair(jnp.asarray(a), jnp.asarray(b), jnp.float32(0.5))
    return from_pairs(pairs)


@functools.cache
def _setup():
    params = numpy_params(CFG, 0)
    per_expert = dataclasses.replace(params, experts=to_layout(params.experts, "per_expert"))
    clean = stack([_adapter(1), _adapter(2), _adapter(3)])
    return params, per_expert, clean


_forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))


# -- a row depends on its own adapter only -------------------------------------------------------------------------


@jax.jit
def _deltas(poisoned, clean, x, ids):
    """pair_delta of two targets (router: out N; shared.up: out Is) for the poisoned and the clean stack, on the
    first GATHER_MAX_ROWS rows (gather form) and on all of them (select form), by row count."""
    names = ("router", "shared.up")
    out = {}
    for R in (moejax.lora.GATHER_MAX_ROWS, x.shape[0]):
        out[R] = [[pair_delta(lora.pairs()[n], x[:R], ids[:R]) for n in names] for lora in (poisoned, clean)]
    return out


def test_pair_delta_rows_never_see_another_adapters_inf():
    """Both forms of the row delta (gather up to GATHER_MAX_ROWS rows, select above): rows of adapter 1 and id 0
    next to rows of an adapter with NaN in A (adapter 2) and inf in B (adapter 3) are finite and bit-identical to
    their delta without those values."""
    _, _, clean = _setup()
    poisoned = stack([_adapter(1), _adapter(2, poison="a"), _adapter(3, poison="b")])
    small, large = moejax.lora.GATHER_MAX_ROWS, moejax.lora.GATHER_MAX_ROWS + 5
    x = jax.random.normal(jax.random.key(0), (large, CFG.hidden_size))
    ids = jnp.arange(large, dtype=jnp.int32) % 4
    deltas = _deltas(poisoned, clean, x, ids)
    for R in (small, large):
        mine = np.asarray(ids[:R]) <= 1
        for got, want in zip(*deltas[R], strict=True):
            got, want = np.asarray(got), np.asarray(want)
            assert np.isfinite(got[mine]).all(), R
            np.testing.assert_array_equal(got[mine], want[mine], err_msg=f"{R}")
            assert not np.isfinite(got[~mine]).all()  # the poisoned adapters' own rows do see it


@functools.partial(jax.jit, static_argnames="impls")
def _plans(params, per_expert, x, lora, ids, impls):
    """moe_forward through each plan of `impls` (the CPU plans on per-expert weights)."""
    run = lambda impl: moejax.moe_forward(
        per_expert if impl.startswith("cpu") else params, x, CFG, impl=impl, lora=lora, adapter_ids=ids
    )
    return [run(impl) for impl in impls]


@pytest.mark.parametrize("T", [6, 40], ids=["decode", "prefill"])
def test_an_adapter_holding_inf_leaves_other_rows_alone(T):
    """Every XLA/CPU plan at T <= 8, the grouped ones at T = 40 (blocks of more than GATHER_MAX_ROWS rows; the
    router and the shared expert see all 40 rows; cpu_grouped's blocks exceed 8 rows at T = 6 too): adapter 2
    holds NaN in A, adapter 3 inf in B of every target (router, experts, shared expert and its gate); rows with
    id 0 or 1 are finite and equal bit for bit to the same program's rows with finite adapters 2 and 3."""
    params, per_expert, clean = _setup()
    poisoned = stack([_adapter(1), _adapter(2, poison="a"), _adapter(3, poison="b")])
    x = jax.random.normal(jax.random.key(T), (T, CFG.hidden_size))
    ids = jnp.arange(T, dtype=jnp.int32) % 4
    mine = np.asarray(ids) <= 1
    impls = PLANS if T <= 8 else ("xla_grouped", "cpu_grouped")  # the decode plans serve up to 8 rows
    got = _plans(params, per_expert, x, poisoned, ids, impls)
    want = _plans(params, per_expert, x, clean, ids, impls)
    for impl, g, w in zip(impls, got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert np.isfinite(g[mine]).all(), impl
        np.testing.assert_array_equal(g[mine], w[mine], err_msg=impl)
        assert not np.isfinite(g[~mine]).all(), impl


# -- ids of any integer type ---------------------------------------------------------------------------------------

# Ids that wrap into 1..3 (or stay out of range) in an int32 cast, where the clean ids are 0.
CLEAN_IDS = np.array([0, 1, 0, 3])
HOSTILE = {
    "int64": np.array([WIDE, 1, -(2**32) + 3, 3], np.int64),
    "uint64": np.array([2**64 - 1, 1, 2**32 + 2, 3], np.uint64),
    "uint32": np.array([2**32 - 1, 1, 2**31 + 1, 3], np.uint32),
    "int8": np.array([-1, 1, 127, 3], np.int8),
    "list": [WIDE, 1, 2**64 + 2, 3],
}


def _batch(kind: str, hostile=None):
    """x [8, H]: two copies of 4 rows, with ids (clean, hostile) in one host array or list of `kind`'s type, passed to
    the forward as they are (constants of the trace, as in an eager call)."""
    hostile = HOSTILE[kind] if hostile is None else hostile
    x = jnp.tile(jax.random.normal(jax.random.key(7), (len(CLEAN_IDS), CFG.hidden_size)), (2, 1))
    if kind == "list":
        return x, [*CLEAN_IDS.tolist(), *hostile]
    return x, np.concatenate([CLEAN_IDS.astype(HOSTILE[kind].dtype), hostile])


def _check_batch(y, what: str, tol: float = 2e-5):
    """The hostile copy equals the clean one (adapter 0 where the clean ids are 0)."""
    clean, hostile = np.split(np.asarray(y), 2)
    np.testing.assert_allclose(hostile, clean, rtol=tol, atol=tol, err_msg=what)


def test_ids_of_any_integer_type_clamp_to_no_adapter():
    """Host int64 / uint64 / uint32 / int8 arrays, a Python list of big ints and a device uint32 array: ids outside
    the stack give adapter 0, never the adapter their low bits name; through moe_forward for host int64 ids and a
    list (constants of the trace: what an eager call passes, without compiling op by op)."""
    expect = np.where(CLEAN_IDS == 0, 0, CLEAN_IDS)
    for kind, ids in [*HOSTILE.items(), ("uint32 on device", jnp.asarray(HOSTILE["uint32"]))]:
        np.testing.assert_array_equal(moejax.lora.clamp_ids(ids, 4), expect, err_msg=kind)
    with pytest.raises(TypeError, match="integers"):
        moejax.lora.as_adapter_ids([0.5, 1], 4)
    params, _, clean = _setup()
    (x, ids64), (_, ids_list) = _batch("int64"), _batch("list")
    _, wrapped = _batch("int64", np.where(CLEAN_IDS == 0, 1, CLEAN_IDS))  # what a wrap to adapter 1 gives
    run = jax.jit(
        lambda params, x, lora: [
            moejax.moe_forward(params, x, CFG, lora=lora, adapter_ids=i) for i in (ids64, ids_list, wrapped)
        ],
    )
    y64, ylist, ywrapped = run(params, x, clean)
    _check_batch(y64, "int64", tol=1e-6)
    _check_batch(ylist, "list", tol=1e-6)
    with pytest.raises(AssertionError):  # the check would see a wrap
        _check_batch(ywrapped, "wrapped")


def test_wide_ids_clamp_on_the_data_parallel_ep_and_layer_paths():
    """Host ids of 2**32 + 1 and the like are adapter 0 with x split over a data axis, under EP in both modes (the
    psum of "replicated" and the rows carrying their ids in "all_to_all") and through the nnx layer: one program."""
    params, _, clean = _setup()
    (x, ids64), (_, ids_u64), (_, ids_list) = _batch("int64"), _batch("uint64"), _batch("list")
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    sharded, placed = sharding.shard_params(params, CFG, mesh), sharding.shard_lora(clean, CFG, mesh)
    ep = functools.partial(parallel.moe_forward_ep, cfg=CFG, mesh=mesh, lora=placed)
    layer = nnx.eval_shape(lambda: moejax.MoE(CFG, rngs=nnx.Rngs(0), layout="stacked"))  # no init to compile
    layer.load_params(params)
    layer.set_lora(clean)
    graph, state = nnx.split(layer)

    @jax.jit
    def run(params, sharded, x, split, lora, state):
        return (
            moejax.moe_forward(params, split, CFG, lora=lora, adapter_ids=ids64),
            ep(sharded, x, mode="replicated", adapter_ids=ids_u64),
            ep(sharded, x, mode="all_to_all", adapter_ids=ids_list),
            nnx.merge(graph, state)(x, adapter_ids=ids64),
        )

    data = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    split = jax.device_put(x, NamedSharding(data, P("data")))
    ys = run(params, sharded, x, split, clean, state)
    for what, y in zip(("data-parallel", "EP replicated", "EP all_to_all", "nnx layer"), ys, strict=True):
        _check_batch(y, what)


def test_checked_forward_raises_for_wide_ids():
    """checked_moe_forward raises for ids outside [0, n] of every integer type (ids a wrap would have hidden as
    adapters 1..3), on one device and with parameters laid out for EP and x split over their mesh."""
    params, _, clean = _setup()
    x = _batch("int64")[0][: len(CLEAN_IDS)]
    for kind in ("int64", "uint64", "list"):
        with pytest.raises(checkify.JaxRuntimeError, match="adapter_ids outside"):
            moejax.checked_moe_forward(params, x, CFG, lora=clean, adapter_ids=HOSTILE[kind])
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    sharded = sharding.shard_params(params, CFG, mesh)
    split = jax.device_put(x, NamedSharding(mesh, P("expert")))  # rows split over the mesh of the EP weights
    with pytest.raises(checkify.JaxRuntimeError, match="adapter_ids outside"):
        moejax.checked_moe_forward(sharded, split, CFG, lora=clean, adapter_ids=[WIDE] * len(CLEAN_IDS))


# -- scalar scales -------------------------------------------------------------------------------------------------


def test_scalar_scales_are_accepted(tmp_path):
    """A LoRAPair with a Python float or numpy scalar scale: is_stack, check_lora, stack, merge and save_adapter."""
    params, _, _ = _setup()
    base = _adapter(1).pairs()
    for scale in (0.5, np.float32(0.5), np.float64(0.5)):
        one = from_pairs({name: LoRAPair(p.a, p.b, scale) for name, p in base.items()})
        assert not one.is_stack
        moejax.lora.check_lora(one, CFG)
        np.testing.assert_array_equal(stack([one]).router.scale, [0.0, 0.5])
    merged = moejax.lora.merge(params, one)
    np.testing.assert_allclose(merged.router.kernel, moejax.lora.merge(params, _adapter(1)).router.kernel)
    hf.save_adapter(one, CFG, 1, tmp_path / "a", family="qwen2_moe")
    assert float(hf.load_adapter(tmp_path / "a", CFG, 1).router.scale) == 0.5


# -- PEFT files ----------------------------------------------------------------------------------------------------

H, E, R = 16, 4, 2
QWEN3 = {"model_type": "qwen3_moe", "hidden_size": H, "num_experts": E, "num_experts_per_tok": 2}
QWEN3 |= {"moe_intermediate_size": 8, "num_hidden_layers": 2}
ROUTER = "base_model.model.model.layers.1.mlp.gate."


def _cfg():
    return hf.config_from_hf(QWEN3, 1)


def _write(path, rank=R, raw=None, **config):
    """An adapter of layer 1's router (rank `rank`, also its config's r); `raw` replaces adapter_config.json."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {
        ROUTER + "lora_A.weight": rng.standard_normal((rank, H)).astype(np.float32),
        ROUTER + "lora_B.weight": rng.standard_normal((E, rank)).astype(np.float32),
    }
    safetensors_numpy.save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    text = json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 4, "target_parameters": ["gate.weight"]} | config)
    with open(os.path.join(path, "adapter_config.json"), "wb") as f:
        f.write(text.encode() if raw is None else raw)
    return path


def test_adapters_assuming_a_modified_base_are_refused(tmp_path):
    """PiSSA-like initialisations move part of W into A and B (peft modifies the base to match): refused, as DoRA
    is. The ones that leave the base as it is (peft 0.21's `update_layer`) load."""
    for init in ("pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga", "some_new_method"):
        with pytest.raises(NotImplementedError, match=r"adapter_config\.json: init_lora_weights=.*not supported"):
            hf.load_adapter(_write(tmp_path / init, init_lora_weights=init), _cfg(), 1)
    for init in (True, False, "gaussian", "eva", "orthogonal", "mica"):
        got = hf.load_adapter(_write(tmp_path / str(init), init_lora_weights=init), _cfg(), 1)
        assert float(got.router.scale) == 2.0


def test_peft_defaults_for_missing_r_and_alpha(tmp_path):
    """peft's LoraConfig defaults: r = 8, lora_alpha = 8 (s = 1)."""
    path = _write(tmp_path / "a", rank=8)
    with open(os.path.join(path, "adapter_config.json")) as f:
        raw = json.load(f)
    del raw["r"], raw["lora_alpha"]
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(raw, f)
    got = hf.load_adapter(path, _cfg(), 1)
    assert got.router.rank == 8 and float(got.router.scale) == 1.0
    raw["lora_alpha"] = 16  # r missing only: 16 / 8
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(raw, f)
    assert float(hf.load_adapter(path, _cfg(), 1).router.scale) == 2.0


def test_rank_zero_is_refused_at_save_and_load(tmp_path):
    """peft refuses r <= 0: save_adapter writes no such target, load_adapter reads none (r or rank_pattern)."""
    cfg = _cfg()
    zero = LoRAParams(router=LoRAPair(jnp.zeros((0, H)), jnp.zeros((E, 0)), jnp.float32(1.0)))
    with pytest.raises(ValueError, match=r"save_adapter: target router has rank 0"):
        hf.save_adapter(zero, cfg, 1, tmp_path / "s", family="qwen3_moe")
    assert not os.path.exists(tmp_path / "s" / "adapter_config.json")
    with pytest.raises(ValueError, match=r"adapter_config\.json: target .*mlp\.gate\.weight has r=0"):
        hf.load_adapter(_write(tmp_path / "a", rank=0), cfg, 1)
    with pytest.raises(ValueError, match=r"target .*mlp\.gate\.weight has r=0"):
        hf.load_adapter(_write(tmp_path / "b", rank_pattern={"gate.weight": 0}), cfg, 1)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"rank_pattern": {"gate[.weight": 2}}, r"rank_pattern pattern 'gate\[\.weight' is not a valid regular"),
        ({"alpha_pattern": {"(gate": 4}}, r"alpha_pattern pattern '\(gate' is not a valid regular"),
        ({"rank_pattern": ["gate"]}, r"rank_pattern must be an object"),
        ({"rank_pattern": {"gate": "two"}}, r"rank_pattern\['gate'\]='two' must be an integer"),
        ({"r": 2.5}, r"r=2\.5 must be an integer"),
        ({"lora_alpha": "4"}, r"lora_alpha='4' must be a finite number"),
        ({"use_rslora": "false"}, r"use_rslora='false' must be true or false"),
    ],
)
def test_bad_config_values_name_the_field(tmp_path, config, match):
    with pytest.raises(ValueError, match=r"adapter_config\.json: " + match):
        hf.load_adapter(_write(tmp_path / "a", **config), _cfg(), 1)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b'{"peft_type": "LORA", ', "is not valid JSON"),
        (b'{"peft_type": "LORA\xff"}', "is not UTF-8"),
        (b'["LORA"]', "must hold a JSON object, got list"),
    ],
    ids=["truncated", "latin1", "list"],
)
def test_malformed_adapter_config_names_the_file(tmp_path, raw, match):
    with pytest.raises(ValueError, match=r"adapter_config\.json (is|must)") as info:
        hf.load_adapter(_write(tmp_path / "a", raw=raw), _cfg(), 1)
    assert match in str(info.value)
