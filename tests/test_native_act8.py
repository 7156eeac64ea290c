"""int8 activations for int8 and 4-bit weights (`Scheme.activations="int8"`, csrc/act8*): the definition by
hand, the native kernels (AVX-512 VNNI, AVX2 and portable, bit for bit) against the emulated float32 reference for
int8 and int4 symmetric and asymmetric, MXFP4 and NVFP4 x SiLU and gpt-oss (shapes whose columns end mid-strip
and groups of 3 code rows), a row's bits alone and inside batches, the XLA plans run the same emulation, the
option off keeps today's bits, bad combinations raise naming the field, and one hypothesis test over shapes."""

import functools
import hashlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import gated

from moejax import backends
from moejax import quantized as Q
from moejax.backends import native
from moejax.backends.reference import reference_routed
from moejax.lora import ExpertLoRA, LoRAPair, adapt
from moejax.quantized.activations import int8_activations
from moejax.slots import Slots
from moejax.weights import ExpertWeights
from pallas_kernels.activations import GatedActivation

built = pytest.mark.skipif(not native.available(), reason="moejax._native_cpu is not built")

ACTIVATIONS = {"silu": GatedActivation("silu"), "gpt_oss": GatedActivation("gpt_oss", limit=0.4, alpha=1.702)}
# (format name, options, H, I): int4 columns ending mid-strip (I = 18, 22, H = 38, 42), groups of 6 inputs (3 code
# rows: an odd last pair), a per-channel scheme (activation groups of 32, a partial last one); int8 groups of 10
# (a last step of 2 of the 4 inputs an int32 lane takes), columns ending mid-way through a second strip (I = 70).
FORMATS = {
    "int8_g10_asym": ("int8", {"group_size": 10, "symmetric": False}, 50, 70),
    "int8_channel_sym": ("int8", {"group_size": None}, 38, 70),
    "int4_g6_sym": ("int4", {"group_size": 6}, 42, 18),
    "int4_channel_asym": ("int4", {"group_size": None, "symmetric": False}, 38, 22),
    "mxfp4": ("mxfp4", {}, 96, 160),
    "nvfp4": ("nvfp4", {}, 48, 80),
}
TIGHT = 3e-5  # float32 rounding, relative to the output's largest value


def _dense(E, H, I, *, bias=False, seed=0) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    n = lambda shape, fan: jnp.asarray((rng.standard_normal(shape) / np.sqrt(fan)).astype(np.float32))
    biases = {"gate_bias": n((E, I), 10), "up_bias": n((E, I), 10), "down_bias": n((E, H), 10)} if bias else {}
    return ExpertWeights(n((E, H, I), H), n((E, H, I), H), n((E, I, H), I), **biases)


@functools.cache
def _experts(name, E=4, *, activations="int8", bias=False, seed=0):
    """Format `name` with `activations`: one quantization per (name, E, bias, seed), the arrays shared by both."""
    fmt, options, H, I = FORMATS[name]
    if activations == "float32":
        return Q.quantize_experts(_dense(E, H, I, bias=bias, seed=seed), Q.format_by_name(fmt, **options))
    arrays = _experts(name, E, activations="float32", bias=bias, seed=seed).fields()
    return Q.format_by_name(fmt, activations=activations, **options)(**arrays)


def _slots(T, K, E, seed=2) -> Slots:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, E + 1, (T, K)).astype(np.int32)  # id E: skipped
    w = np.where(idx < E, rng.uniform(0.1, 1.0, (T, K)), 0).astype(np.float32)  # Slots: weight 0 when skipped
    return Slots(jnp.asarray(idx), jnp.asarray(w))


def _x(T, H, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((T, H)).astype(np.float32))


_reference = jax.jit(reference_routed, static_argnames="act")


@functools.cache
def _dequantized(name, bias) -> dict:
    """The float32 weights of `_experts(name, bias=bias)` as float64 numpy arrays (one jit per format)."""
    d = jax.jit(lambda e: e.dequantize())(_experts(name, activations="float32", bias=bias))
    return {k: np.asarray(v, np.float64) for k, v in d.fields().items()}


def _int8_np(v: np.ndarray, group: int | None) -> np.ndarray:
    """`int8_activations` in numpy float32 (the module docstring's steps); None: v unchanged."""
    v = np.asarray(v, np.float32)
    if group is None:
        return v
    R, n = v.shape
    vg = np.pad(v, ((0, 0), (0, -n % group))).reshape(R, -1, group)
    s = (np.abs(vg).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(s > 0, np.clip(np.round(vg / s), -127, 127), 0).astype(np.float32)
    return (q * s).reshape(R, -1)[:, :n]


def _oracle(name, x, slots: Slots, act, *, bias=False, group="scheme") -> np.ndarray:
    """`_oracle_of` the format `name` (group None: float32 activations)."""
    group = _experts(name).scheme.activation_group if group == "scheme" else group
    return _oracle_of(_dequantized(name, bias), group, x, slots, act, bias)


def _oracle_of(d: dict, group, x, slots: Slots, act=ACTIVATIONS["silu"], bias=False) -> np.ndarray:
    """float64 routed sum over the dequantized weights `d`, each projection's input through `_int8_np`."""
    x, idx, w = np.asarray(x), np.asarray(slots.indices), np.asarray(slots.out_weight, np.float64)
    out = np.zeros(x.shape)
    for t, k in np.ndindex(*idx.shape):
        e = idx[t, k]
        if e >= d["gate"].shape[0]:
            continue
        xe = _int8_np(x[t : t + 1], group).astype(np.float64)
        g, u = xe @ d["gate"][e], xe @ d["up"][e]
        if bias:
            g, u = g + d["gate_bias"][e], u + d["up_bias"][e]
        y = _int8_np(gated(act, g, u), group).astype(np.float64) @ d["down"][e]
        out[t] += w[t, k] * (y[0] + (d["down_bias"][e] if bias else 0))
    return out


def _rel_err(got, want) -> float:
    want = np.asarray(want)
    return float(np.abs(np.asarray(got) - want).max() / max(1e-30, np.abs(want).max()))


def _isa(name):
    module = native._module()
    return module.set_isa(name)


def _strip(name):
    """The AVX-512 variant's int8-activation strips: 'vbmi', 'vnni', 'maddubs' (at most the CPU's) or 'best'."""
    return native._module().set_act8_strip(name)


def _every_variant(run, best):
    """run() under each lower int8-activation strip of the AVX-512 variant and each lower ISA: best's bits."""
    try:
        for strip in ("vnni", "maddubs"):
            if _strip(strip) == strip:
                np.testing.assert_array_equal(np.asarray(run()), best, strip)
        _strip("best")
        for isa in ("avx2", "generic"):
            if _isa(isa) == isa:
                np.testing.assert_array_equal(np.asarray(run()), best, isa)
    finally:
        _strip("best")
        _isa("best")


# -- the definition -----------------------------------------------------------------------------------------------


def test_int8_activations_by_hand():
    """Groups of 4, max 127 so s = 1: half to even, clip, a zero group, a NaN group, a partial last group."""
    x = jnp.asarray(
        [[2.5, -127.0, 3.5, 0.4, 0.0, 0.0, 0.0, 0.0, 1.0, jnp.nan, 2.0, 3.0, 254.0, -1.0]], jnp.float32
    )  # groups [2.5 -127 3.5 .4] [0 0 0 0] [1 nan 2 3] [254 -1]
    got = np.asarray(jax.jit(int8_activations, static_argnums=1)(x, 4))[0]
    np.testing.assert_array_equal(got[:8], [2.0, -127.0, 4.0, 0.0, 0, 0, 0, 0])
    assert np.isnan(got[8:12]).all()
    np.testing.assert_array_equal(got[12:], [254.0, 0.0])  # s = 2: -1 / 2 = -0.5 -> -0 (half to even)
    grad = jax.jit(jax.grad(lambda x: int8_activations(x, 4).sum()))(x)
    np.testing.assert_array_equal(grad, np.ones(x.shape))  # straight through


# -- the kernels against the emulated reference -------------------------------------------------------------------


@built
@pytest.mark.parametrize("act_name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_kernel_matches_the_emulated_reference(name, act_name):
    """Every ISA against the float64 oracle of the emulation to float32 rounding, bit-identical to each other (the
    best one: AVX-512 with VNNI's vpdpbusd where the CPU has it, the 4-bit codes spread by VBMI's byte permutes where
    it has those; the AVX-512 strips without them; AVX2's vpmaddubsw + vpmaddwd; the portable loop); and visibly
    different from the float32-activation result (the option is not ignored)."""
    act, bias = ACTIVATIONS[act_name], True
    experts = _experts(name, bias=bias)
    H = FORMATS[name][2]
    x, slots = _x(5, H), _slots(5, 3, 4)
    want = _oracle(name, x, slots, act, bias=bias)
    best = np.asarray(native.routed_experts(experts, x, slots, act))
    _every_variant(lambda: native.routed_experts(experts, x, slots, act), best)
    assert _rel_err(best, want) <= TIGHT, _rel_err(best, want)
    assert _rel_err(best, _oracle(name, x, slots, act, bias=bias, group=None)) > 1e-3


def _cpu_flags() -> set[str]:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@built
@pytest.mark.skipif(
    native.isa() != "avx512" or not pathlib.Path("/proc/cpuinfo").exists(), reason="an AVX-512 Linux machine"
)
def test_the_best_strips_are_the_cpus():
    """The strips chosen at load are the best this CPU runs (the tier comparisons above would pass with it off)."""
    flags = _cpu_flags()
    want = "maddubs" if "avx512_vnni" not in flags else "vbmi" if "avx512vbmi" in flags else "vnni"
    assert _strip("best") == want


@built
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_every_scale_byte_decodes_alike_in_every_isa(name):
    """The down projection's scale bytes set to every value 0..255 (NaN, subnormal e4m3, e8m0's 0 and 254
    included), one byte per (expert, output column) across all its groups, each row routed to one expert: every ISA
    gives the same bits (the AVX-512 variant loads 32 scale bytes a vector, the others decode them one by one)."""
    E = 6
    H = FORMATS[name][2]
    arrays = _experts(name, E).fields()
    shape = arrays["down_scale"].shape  # [E, I / group, H]
    byte = (np.arange(E)[:, None] * H + np.arange(H)) % 256  # [E, H]
    assert len(np.unique(byte)) == 256
    scale = np.broadcast_to(byte[:, None, :], shape).astype(np.uint8)
    arrays["down_scale"] = jnp.asarray(scale.view(arrays["down_scale"].dtype))
    experts = type(_experts(name, E))(**arrays)
    x = _x(E, H)
    slots = Slots(jnp.arange(E, dtype=jnp.int32)[:, None], jnp.ones((E, 1), jnp.float32))
    best = np.asarray(native.routed_experts(experts, x, slots, ACTIVATIONS["silu"]))
    assert 0.5 < np.isfinite(best).mean() < 1  # NaN scales give NaN columns, the others values
    _every_variant(lambda: native.routed_experts(experts, x, slots, ACTIVATIONS["silu"]), best)


@built
@pytest.mark.parametrize("name", ["int4_channel_asym", "int8_g10_asym"])
def test_a_rows_bits_do_not_depend_on_the_batch_or_threads(name):
    """Row 0 alone, then at positions 0 / 4 / 8 of batches with other rows, on 1 thread and on all of them."""
    experts = _experts(name, E=6)
    act = ACTIVATIONS["silu"]
    H = FORMATS[name][2]
    x, slots = _x(9, H, seed=5), _slots(9, 4, 6, seed=6)
    row = lambda t: (x[t : t + 1], Slots(slots.indices[t : t + 1], slots.out_weight[t : t + 1]))
    alone = np.asarray(native.routed_experts(experts, *row(4), act, max_threads=1))[0]
    for T, at in ((5, 4), (9, 4)):
        got = np.asarray(native.routed_experts(experts, x[:T], Slots(slots.indices[:T], slots.out_weight[:T]), act))
        np.testing.assert_array_equal(got[at], alone)
    rolled = lambda a: jnp.roll(a, -4, axis=0)  # the row at position 0, its neighbours shifted
    got = native.routed_experts(experts, rolled(x), Slots(rolled(slots.indices), rolled(slots.out_weight)), act)
    np.testing.assert_array_equal(np.asarray(got)[0], alone)


@built
@pytest.mark.parametrize(
    "kind, options",
    [("int8", {"group_size": 32}), ("int4", {"group_size": 16, "symmetric": False}), ("mxfp4", {})],
    ids=["int8_g32", "int4_g16_asym", "mxfp4"],
)
def test_decode_whole_row_chunks_match_the_batch_bit_for_bit(kind, options):
    """Decode (every chosen expert one row) on one thread takes each projection's columns as one chunk (whole code
    rows per item, K blocks of contiguous rows: moe_cpu.cc set_chunks); a batch whose rows share their experts takes
    256-column chunks: the row alone equals its batch row bit for bit, and the oracle. The batch's chunks 256 + 96
    (I=352) and 256 + 256 + 32 (H=544) columns, the row alone's whole rows of 352 and 544: none a multiple of the
    64-column strip."""
    E, T, H, I = 3, 9, 544, 352  # 9 rows per expert: past kWideRowsPerExpert (8), the 256-column chunks
    experts = Q.quantize_experts(_dense(E, H, I, seed=4), Q.format_by_name(kind, activations="int8", **options))
    act = ACTIVATIONS["silu"]
    x = _x(T, H, seed=5)
    one = Slots(jnp.asarray([[2, 0]], jnp.int32), jnp.asarray([[0.7, 0.4]], jnp.float32))
    slots = Slots(jnp.repeat(one.indices, T, 0), jnp.repeat(one.out_weight, T, 0))
    got = np.asarray(native.routed_experts(experts, x, slots, act))
    d = {k: np.asarray(v, np.float64) for k, v in jax.jit(lambda e: e.dequantize())(experts).fields().items()}
    assert _rel_err(got, _oracle_of(d, experts.scheme.activation_group, x, slots, act)) <= TIGHT
    for t in (0, 8):
        alone = native.routed_experts(experts, x[t : t + 1], one, act, max_threads=1)
        np.testing.assert_array_equal(np.asarray(alone)[0], got[t], err_msg=f"{kind}: row {t}")


@built
def test_h_rows_finished_by_several_gate_up_items():
    """I = 300: a union expert's gate/up in two column chunks (256 + 44 columns), its h rows quantized by whichever
    item finishes them: against the oracle, one thread and the pool bit-identical, a row's bits as when alone."""
    E, H, I = 3, 20, 300
    scheme = Q.format_by_name("int8", group_size=10, activations="int8")
    experts = Q.quantize_experts(_dense(E, H, I, seed=3), scheme)
    x, slots = _x(4, H, seed=7), _slots(4, 2, E, seed=8)
    d = {k: np.asarray(v, np.float64) for k, v in jax.jit(lambda e: e.dequantize())(experts).fields().items()}
    act = ACTIVATIONS["silu"]
    pool = np.asarray(native.routed_experts(experts, x, slots, act))
    assert _rel_err(pool, _oracle_of(d, 10, x, slots, act)) <= TIGHT
    np.testing.assert_array_equal(np.asarray(native.routed_experts(experts, x, slots, act, max_threads=1)), pool)
    alone = native.routed_experts(experts, x[2:3], Slots(slots.indices[2:3], slots.out_weight[2:3]), act)
    np.testing.assert_array_equal(np.asarray(alone)[0], pool[2])


@built
def test_lora_deltas_stay_float32_beside_int8_activations():
    """Adapters on the int8-activation path: the reference's LoRAExpert over the emulated projections."""
    E, H, I = 4, *FORMATS["nvfp4"][2:]
    rng = np.random.default_rng(3)
    pair = lambda n_in, n_out: LoRAPair(
        jnp.asarray(rng.standard_normal((2, E, 4, n_in)).astype(np.float32) / np.sqrt(n_in)),
        jnp.asarray(rng.standard_normal((2, E, n_out, 4)).astype(np.float32)),
        jnp.asarray([0.0, 0.5], jnp.float32),
    )
    lora = ExpertLoRA(gate=pair(H, I), up=pair(H, I), down=pair(I, H))
    experts = adapt(_experts("nvfp4", E), lora)
    x, slots = _x(4, H), _slots(4, 2, E)
    slots = Slots(slots.indices, slots.out_weight, None, jnp.asarray([1, 0, 1, 1], jnp.int32))
    act = ACTIVATIONS["silu"]
    want = _reference(experts, x, slots, act)
    assert _rel_err(native.routed_experts(experts, x, slots, act), want) <= TIGHT


@pytest.mark.parametrize("name", ["mxfp4", "int8_g10_asym"])
def test_the_reference_and_the_xla_plans_run_the_same_emulation(name):
    """reference_routed and the XLA decode plan (what "auto" falls back to without the extension) against the
    oracle, in one program."""
    experts = _experts(name)
    x, slots, act = _x(3, FORMATS[name][2]), _slots(3, 2, 4), ACTIVATIONS["silu"]
    run = lambda e, x, s: [backends.run_routed(impl, e, x, s, act) for impl in ("reference", "xla_decode")]
    want = _oracle(name, x, slots, act)
    for impl, got in zip(("reference", "xla_decode"), jax.jit(run)(experts, x, slots), strict=True):
        assert _rel_err(got, want) <= TIGHT, impl


@built
def test_auto_runs_the_option_natively():
    experts = _experts("int4_g6_sym")
    x, slots = _x(2, 42), _slots(2, 2, 4)
    assert backends.resolve_impl("auto", experts, x, slots, ACTIVATIONS["silu"]) == "native"


# -- the option off: today's names and bits -----------------------------------------------------------------------

# sha256 of the native output of `_golden` before the option existed (main at 27dca14, its extension).
GOLDEN = {
    ("avx2", "int4_g6_sym"): "a65645889d5d828022cc26f06490b3013e42ac9d364a1499e30548c292f7ebe2",
    ("avx2", "mxfp4"): "87914c104c048b40884a5afa4961d794eedd47c4aa555172f028b25d4c796895",
    ("avx2", "nvfp4"): "801937c4900f395a256a7be45a3850c19de04d5eb88a4841261c6ab430389d83",
    ("generic", "int4_g6_sym"): "77385da58f93e9e97272ea9040f1836b2514bb3b050fe30ea65aa5d34405161a",
    ("generic", "mxfp4"): "520bc6b7a52bebbd057be298e47cd49a46e89add39c4c68712688f0c05fcc91f",
    ("generic", "nvfp4"): "07d5ab8efbd750db8fcb8f5ba79b2b991b2ceb1d71dc1a24535d61a05f7f98a8",
}


def _golden(name) -> str:
    experts = _experts(name, activations="float32", bias=True)
    x, slots = _x(3, FORMATS[name][2]), _slots(3, 2, 4)
    out = np.asarray(native.routed_experts(experts, x, slots, ACTIVATIONS["gpt_oss"]), np.float32)
    return hashlib.sha256(out.tobytes()).hexdigest()


def test_the_default_keeps_its_names():
    assert Q.Scheme("int", 4, 128).activations == "float32"
    assert Q.format_by_name("int4") is Q.format_by_name("int4", activations="float32")
    assert Q.quantized_format("int", bits=4, group_size=128) is Q.format_by_name("int4")  # one scheme, one class
    assert (
        Q.format_by_name("int4").__name__ == "Int4G128Sym" and Q.format_by_name("int4").scheme.name == "int4_g128_sym"
    )
    assert Q.format_by_name("mxfp4", activations="int8").__name__ == "Mxfp4A8"
    assert Q.format_by_name("int4", symmetric=False, activations="int8").scheme.name == "int4_g128_asym_a8"


@built
@pytest.mark.skipif(native.isa() not in ("avx2", "avx512"), reason="the hashes were taken on x86-64 with AVX2")
@pytest.mark.parametrize("name", ["int4_g6_sym", "mxfp4", "nvfp4"])
def test_the_option_off_gives_todays_bits(name):
    """The AVX-512 variant (where the CPU has it) gives the AVX2 variant's pinned bits."""
    try:
        for isa in ("avx512", "avx2", "generic"):
            if _isa(isa) == isa:
                assert _golden(name) == GOLDEN[("generic" if isa == "generic" else "avx2", name)], isa
    finally:
        _isa("best")


# -- bad combinations ---------------------------------------------------------------------------------------------


def test_bad_combinations_name_the_field():
    for name, options in (("fp8_block", {}),):
        with pytest.raises(NotImplementedError, match="activations='int8'"):
            Q.format_by_name(name, activations="int8", **options)
    with pytest.raises(ValueError, match="activations='bfloat16'"):
        Q.format_by_name("int4", activations="bfloat16")
    with pytest.raises(ValueError, match="activations='int4'"):
        Q.Scheme("mxfp4", 4, 32, activations="int4")
    experts = _experts("int4_g6_sym")
    x, slots = _x(2, 42), _slots(2, 2, 4)
    with pytest.raises(NotImplementedError, match="activations='int8'"):
        backends.run_routed("pallas_decode", experts, x, slots, ACTIVATIONS["silu"])


# -- shapes -------------------------------------------------------------------------------------------------------


@built
@settings(max_examples=5)
@given(
    fmt=st.sampled_from(["int8_sym", "int8_asym", "int4_sym", "int4_asym", "mxfp4", "nvfp4"]),
    h_groups=st.integers(1, 5),
    i_groups=st.integers(1, 5),
    T=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_shapes(fmt, h_groups, i_groups, T, seed):
    """Against the reference with a looser bound: a 1-ulp difference of h between the kernel and XLA (std::exp vs
    XLA's) can flip one int8 code of the down input, an error of one quantization step of one element."""
    kind, group = {
        "int8_sym": ("int8", 6),
        "int8_asym": ("int8", 14),
        "int4_sym": ("int4", 8),
        "int4_asym": ("int4", 8),
        "mxfp4": ("mxfp4", 32),
        "nvfp4": ("nvfp4", 16),
    }[fmt]
    options = {"group_size": group, "symmetric": not fmt.endswith("_asym")} if kind.startswith("int") else {}
    H, I, E = group * h_groups + 0, group * i_groups, 5
    experts = Q.quantize_experts(_dense(E, H, I, seed=seed), Q.format_by_name(kind, activations="int8", **options))
    x, slots = _x(T, H, seed), _slots(T, 2, E, seed)
    d = {k: np.asarray(v, np.float64) for k, v in jax.jit(lambda e: e.dequantize())(experts).fields().items()}
    want = _oracle_of(d, experts.scheme.activation_group, x, slots)
    assert _rel_err(native.routed_experts(experts, x, slots, ACTIVATIONS["silu"]), want) <= 2e-3
