"""octet's Python API on the CPU with NumPy: bit-exact quantization against an independent
reference, the FP8 GEMM on small integers, Linear against NumPy math, DLPack zero-copy, and bad
input raising with octet's message."""
import ctypes
import gc
import sys
import weakref

import numpy as np
import pytest

import octet
from fp8_reference import decode, encode, floor_pow2

ROWS, COLS = 37, 300  # awkward on purpose: a partial 1x128 block per row


def ptr(a):
    return a.__array_interface__["data"][0]


@pytest.fixture
def x(rng):
    return rng.uniform(-3, 3, (ROWS, COLS)).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Recipes and autocast


def test_recipes_follow_transformer_engine_defaults():
    d = octet.Recipe.delayed()
    assert d.name == "fp8-delayed"
    assert d.fields == {"kind": "delayed", "fp8_format": "hybrid", "margin": 0,
                        "amax_history_len": 1024, "amax_compute_algo": "max",
                        "power_of_2_scales": False}
    assert octet.Recipe.current().name == "fp8-current"
    assert octet.Recipe.block().fields["fp8_format"] == "e4m3"
    assert octet.Recipe.mxfp8().name == "fp8-mxfp8"
    assert octet.Recipe.from_name("fp8-block").name == "fp8-block"


@pytest.mark.parametrize("kwargs, needle", [
    ({"amax_history_len": 0}, "history"),
    ({"margin": -1}, "margin"),
    ({"fp8_format": "e6m1"}, "fp8_format"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
])
def test_bad_recipes_raise_with_octets_message(kwargs, needle):
    with pytest.raises(octet.OctetValueError, match=needle):
        octet.Recipe.delayed(**kwargs)


def test_autocast_scope_finalizes_the_forward_pass_once():
    reg = octet.Registry()
    before = reg.update_counts
    with octet.fp8_autocast(octet.Recipe.delayed(), registry=reg):
        assert octet.active_scope() is not None
    assert octet.active_scope() is None
    assert reg.update_counts == (before[0] + 1, before[1])
    with octet.fp8_autocast(octet.Recipe.current(), enabled=False, registry=reg):
        assert octet.active_scope() is None
    assert reg.update_counts[0] == before[0] + 1


def test_an_autocast_object_is_reusable_reentrant_and_closes_on_error():
    reg = octet.Registry()
    scope = octet.fp8_autocast(octet.Recipe.delayed(), registry=reg)
    with scope:
        with scope:
            assert octet._lib.lib.octet_autocast_depth() == 2
        assert octet.active_scope().registry is reg
    with pytest.raises(KeyError):
        with scope:
            raise KeyError("the body's error propagates")
    assert octet.active_scope() is None and octet._lib.lib.octet_autocast_depth() == 0

    @octet.fp8_autocast(octet.Recipe.current(), registry=reg)
    def body():
        return octet.active_scope().recipe.name

    assert body() == body() == "fp8-current"
    assert reg.update_counts[0] == 5  # every scope closed finalizes once


# ------------------------------------------------------------------------------------------------
# Quantize / dequantize, bit-exact


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_quantize_is_bit_exact(x, fmt):
    scale = np.array([37.5], np.float32)
    q = octet.quantize(x, dtype=fmt, scale=scale, columnwise=True)
    assert (q.dtype, q.mode, q.shape) == (fmt, "per_tensor", (ROWS, COLS))
    want = encode(x * scale[0], fmt)
    np.testing.assert_array_equal(q.data(), want)
    np.testing.assert_array_equal(q.data(transposed=True), want.T)
    assert q.scale_inv()[0] == np.float32(1) / scale[0]
    # dequantize = decode(code) * scale_inv, bitwise, both copies.
    np.testing.assert_array_equal(octet.dequantize(q), decode(want, fmt) * q.scale_inv()[0])
    np.testing.assert_array_equal(octet.dequantize(q, transposed=True),
                                  (decode(want, fmt) * q.scale_inv()[0]).T)


def test_current_scaling_uses_the_tensors_own_amax_and_writes_amax_in_place(x):
    amax = np.array([0.5], np.float32)
    q = octet.quantize(x, amax=amax)
    expected_amax = np.abs(x).max()
    assert amax[0] == expected_amax  # octet wrote into NumPy's memory: no copy
    scale = np.float32(448) / expected_amax
    np.testing.assert_array_equal(q.data(), encode(x * scale, "e4m3"))
    q2 = octet.quantize(x, power_of_2_scales=True)
    np.testing.assert_array_equal(q2.data(), encode(x * floor_pow2(scale), "e4m3"))


def test_block_1x128_quantize_is_bit_exact(x):
    q = octet.quantize(x, mode="block_1x128")
    blocks = -(-COLS // 128)
    scales = np.empty((ROWS, blocks), np.float32)
    for b in range(blocks):
        amax = np.abs(x[:, b * 128:(b + 1) * 128]).max(axis=1)
        scales[:, b] = floor_pow2(np.float32(448) / amax)
    per_element = np.repeat(scales, 128, axis=1)[:, :COLS]
    np.testing.assert_array_equal(q.data(), encode(x * per_element, "e4m3"))
    np.testing.assert_array_equal(q.scale_inv(), np.float32(1) / scales)


def test_mxfp8_round_trip_within_half_an_e4m3_ulp(x):
    q = octet.quantize(x, mode="mxfp8_1x32", columnwise=True)
    assert q.scale_inv().dtype == np.uint8 and q.scale_inv().shape == (ROWS, -(-COLS // 32))
    for transposed, ref in ((False, x), (True, x.T)):
        dq = octet.dequantize(q, transposed=transposed)
        assert np.all(np.abs(dq - ref) <= 2.0**-4 * np.abs(ref) + 1e-6)


def test_quantize_views_are_zero_copy(x):
    q = octet.quantize(x, columnwise=True)
    assert ptr(q.data()) == ptr(q.data())
    out = np.empty_like(x)
    assert octet.dequantize(q, out=out) is out
    assert np.any(out != 0)


# ------------------------------------------------------------------------------------------------
# FP8 GEMM


def test_fp8_gemm_is_exact_on_small_integers(rng):
    m, n, k = 32, 48, 64
    a = rng.integers(-8, 9, (m, k)).astype(np.float32)
    b = rng.integers(-8, 9, (n, k)).astype(np.float32)
    bias = rng.integers(-4, 5, n).astype(np.float32)
    one = np.ones(1, np.float32)
    qa, qb = octet.quantize(a, scale=one), octet.quantize(b, scale=one)
    np.testing.assert_array_equal(octet.gemm(qa, qb, bias=bias), a @ b.T + bias)
    out = np.full((m, n), 1.0, np.float32)
    octet.gemm(qa, qb, out=out, alpha=2.0, beta=1.0, fast_accum=True)
    np.testing.assert_array_equal(out, 2 * (a @ b.T) + 1)


def test_fp8_gemm_rejects_dimensions_off_the_16_grid(rng):
    a = octet.quantize(rng.uniform(-1, 1, (17, 64)).astype(np.float32))
    b = octet.quantize(rng.uniform(-1, 1, (16, 64)).astype(np.float32))
    with pytest.raises(octet.OctetError, match="16"):
        octet.gemm(a, b)


# ------------------------------------------------------------------------------------------------
# Linear against NumPy

# Tolerances, relative to sum_k |a_k b_k| (the size of the terms): f32 differs only in summation
# order; FP8 rounds each operand to 2^-4 (E4M3) or 2^-3 (E5M2 gradients) of itself, and a
# product of two rounded operands is within (1 + 2^-4)(1 + 2^-3) - 1 < 0.2 of its magnitude.
F32_TOL, FP8_FWD_TOL, FP8_BWD_TOL = 1e-5, 0.13, 0.2


def assert_matmul_close(got, a, b, tol, add=None):
    ref = a.astype(np.float64) @ b.astype(np.float64)
    if add is not None:
        ref = ref + add
    bound = tol * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)) + 1e-6
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) - bound)


@pytest.mark.parametrize("recipe", [None, "fp8-delayed", "fp8-current", "fp8-block", "fp8-mxfp8"])
def test_linear_forward_backward_match_numpy(rng, recipe):
    lin = octet.Linear(64, 32, bias=True, seed=7)
    x = rng.uniform(-1, 1, (2, 24, 64)).astype(np.float32)
    dy = rng.uniform(-0.01, 0.01, (2, 24, 32)).astype(np.float32)
    w, b = lin.weight, lin.bias
    fwd, bwd = (F32_TOL, F32_TOL) if recipe is None else (FP8_FWD_TOL, FP8_BWD_TOL)
    reg = octet.Registry()
    with octet.fp8_autocast(octet.Recipe.from_name(recipe) if recipe else None,
                            enabled=recipe is not None, registry=reg):
        y, record = lin.forward(x)
    assert y.shape == (2, 24, 32) and y.dtype == np.float32
    x2, dy2 = x.reshape(-1, 64), dy.reshape(-1, 32)
    assert_matmul_close(y.reshape(-1, 32), x2, w.T, fwd, add=b)
    dx = lin.backward(dy, record)
    assert dx.shape == x.shape
    assert_matmul_close(dx.reshape(-1, 64), dy2, w, bwd)
    assert_matmul_close(lin.grad_weight, dy2.T, x2, bwd)
    np.testing.assert_allclose(lin.grad_bias, dy2.sum(axis=0), rtol=1e-5, atol=1e-6)
    if recipe:
        reg.finalize_backward()
        assert lin.fp8_update_counts == (1, 1)


def test_linear_views_share_octets_memory_and_gradients_accumulate(rng):
    lin = octet.Linear(32, 16, seed=3)
    assert ptr(lin.weight) == ptr(lin.weight)
    x = rng.uniform(-1, 1, (16, 32)).astype(np.float32)
    dy = rng.uniform(-1, 1, (16, 16)).astype(np.float32)
    _, r1 = lin.forward(x)
    lin.backward(dy, r1)
    once = lin.grad_weight.copy()
    _, r2 = lin.forward(x)
    lin.backward(dy, r2)
    np.testing.assert_allclose(lin.grad_weight, 2 * once, rtol=1e-6)
    lin.zero_grad()
    assert not lin.grad_weight.any()
    w = lin.weight
    w *= 0  # an optimizer step through the view
    lin.weights_updated()
    y, _ = lin.forward(x)
    np.testing.assert_array_equal(y, np.broadcast_to(lin.bias, y.shape))


@pytest.mark.parametrize("norm", [None, "layernorm"])
def test_recompute_gives_bitwise_the_same_gradients(rng, norm):
    recipe = octet.Recipe.delayed(amax_history_len=4)
    lin = octet.Linear(64, 32, seed=11, norm=norm)
    grad_names = ["grad_weight"] + (["grad_norm_weight", "grad_norm_bias"] if norm else [])
    x = rng.uniform(-1, 1, (48, 64)).astype(np.float32)
    dy = rng.uniform(-1, 1, (48, 32)).astype(np.float32)
    reg = octet.Registry()
    for _ in range(2):  # a second step runs with scales from the first
        with octet.fp8_autocast(recipe, registry=reg):
            y, record = lin.forward(x)
        lin.zero_grad(on_next_write=True)
        dx = lin.backward(dy, record)
        reg.finalize_backward()
    grads = [lin.view(name).copy() for name in grad_names]
    counts = lin.fp8_update_counts
    record.release_activations()
    with pytest.raises(octet.OctetValueError, match="released"):
        lin.backward(dy, record)
    y2, again = lin.forward(x, mode="recompute", original=record)
    lin.zero_grad(on_next_write=True)
    dx2 = lin.backward(dy, again)
    assert y.tobytes() == y2.tobytes() and dx.tobytes() == dx2.tobytes()
    for name, grad in zip(grad_names, grads):
        assert grad.tobytes() == lin.view(name).tobytes(), name
    assert lin.fp8_update_counts == counts


def test_fp8_state_round_trips_through_a_checkpoint(rng):
    recipe = octet.Recipe.delayed(amax_history_len=8)
    a, b = octet.Linear(32, 16, seed=1), octet.Linear(32, 16, seed=1)
    reg = octet.Registry()
    with octet.fp8_autocast(recipe, registry=reg):
        a.forward(rng.uniform(-1, 1, (16, 32)).astype(np.float32))
    state = a.fp8_state(recipe)
    assert set(state) == {"forward.scale", "forward.scale_inv", "forward.amax_history",
                          "backward.scale", "backward.scale_inv", "backward.amax_history"}
    assert state["forward.amax_history"].shape == (8, 2)
    assert state["forward.scale"][0] != 1.0  # updated by the pass
    b.load_fp8_state(recipe, state)
    for name, value in b.fp8_state(recipe).items():
        assert value.tobytes() == state[name].tobytes(), name
    bad = dict(state, **{"forward.scale": np.ones(3, np.float32)})
    with pytest.raises(octet.OctetValueError, match=r"f32\[2\]"):
        b.load_fp8_state(recipe, bad)


def rel_l2(got, ref):
    """||got - ref|| / ||ref||, in float64."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def norm_reference(x, norm, gamma, beta, eps):
    """LayerNorm or RMSNorm over the last axis in float64, and the Jacobian-vector product of its
    input gradient for an output gradient g."""
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True) if norm == "layernorm" else 0.0
    xc = x - mean
    rstd = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    xhat = xc * rstd
    h = xhat * gamma + (beta if beta is not None else 0.0)

    def dx_of(g):
        dxhat = g * gamma
        d = dxhat - (xhat * (dxhat * xhat).mean(-1, keepdims=True))
        if norm == "layernorm":
            d = d - dxhat.mean(-1, keepdims=True)
        return rstd * d
    return h, xhat, dx_of


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("recipe", [None, "fp8-delayed", "fp8-current"])
def test_a_normed_linear_is_the_norm_then_the_linear(rng, norm, recipe):
    """y = norm(x) W^T + b and every gradient (x, W, b, gamma, beta) against NumPy in float64;
    under delayed scaling the second step's norm writes the GEMM's FP8 input itself."""
    lin = octet.Linear(64, 32, bias=True, seed=7, norm=norm, eps=1e-5)
    assert (lin.norm_bias is not None) == (norm == "layernorm")
    lin.norm_weight[:] = rng.uniform(0.5, 1.5, 64)
    if norm == "layernorm":
        lin.norm_bias[:] = rng.uniform(-0.5, 0.5, 64)
    gamma, beta = lin.norm_weight.copy(), None if norm == "rmsnorm" else lin.norm_bias.copy()
    w, b = lin.weight, lin.bias
    x = rng.uniform(-2, 2, (2, 24, 64)).astype(np.float32)
    dy = rng.uniform(-0.01, 0.01, (2, 24, 32)).astype(np.float32)
    fwd, bwd = (F32_TOL, F32_TOL) if recipe is None else (FP8_FWD_TOL, FP8_BWD_TOL)
    reg = octet.Registry()
    h, xhat, dx_of = norm_reference(x, norm, gamma, beta, 1e-5)
    h2, dy2 = h.reshape(-1, 64), dy.reshape(-1, 32)
    for step in range(2):  # delayed scaling fuses the cast from the second step on
        lin.zero_grad()
        with octet.fp8_autocast(octet.Recipe.from_name(recipe) if recipe else None,
                                enabled=recipe is not None, registry=reg):
            y, record = lin.forward(x)
        assert y.shape == (2, 24, 32)
        assert_matmul_close(y.reshape(-1, 32), h2, w.T, fwd, add=b)
        dx = lin.backward(dy, record)
        if recipe:
            reg.finalize_backward()
    assert dx.shape == x.shape
    # The norm's gradients go through the GEMM's dgrad, which FP8 computes from E5M2 dy (2
    # mantissa bits) and E4M3 W: a relative L2 error of 4-7% there (1e-7 in f32).
    rel = 1e-5 if recipe is None else 0.12
    dh = dy2.astype(np.float64) @ w  # the exact norm-output gradient
    assert rel_l2(dx.reshape(-1, 64), dx_of(dh.reshape(x.shape)).reshape(-1, 64)) < rel
    assert_matmul_close(lin.grad_weight, dy2.T, h2, bwd)
    np.testing.assert_allclose(lin.grad_bias, dy2.sum(axis=0), rtol=1e-5, atol=1e-6)
    assert rel_l2(lin.view("grad_norm_weight"), (dh * xhat.reshape(-1, 64)).sum(axis=0)) < rel
    if norm == "layernorm":
        assert rel_l2(lin.view("grad_norm_bias"), dh.sum(axis=0)) < rel


def test_bad_normed_linears_raise():
    with pytest.raises(octet.OctetValueError, match="norm"):
        octet.Linear(16, 16, norm="batchnorm")
    with pytest.raises(octet.OctetValueError, match="epsilon must be positive"):
        octet.Linear(16, 16, norm="layernorm", eps=0.0)
    with pytest.raises(octet.OctetValueError, match="RMSNorm has no beta"):
        octet.Linear(16, 16, norm="rmsnorm").view("norm_bias")
    with pytest.raises(octet.OctetValueError, match="has no norm"):
        octet.Linear(16, 16).view("norm_weight")
    assert octet.Linear(16, 16).norm_weight is None


def mlp_reference(h, activation, w1, b1, w2, b2, dy):
    """fc2(act(fc1(h))) in float64, and the gradients of h, fc1's output and the activation."""
    a = h @ w1.T + b1
    if activation == "gelu":
        c = np.sqrt(2.0 / np.pi)
        t = np.tanh(c * (a + 0.044715 * a**3))
        act = 0.5 * a * (1.0 + t)
        dact_da = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * a * a)
    elif activation == "srelu":
        act, dact_da = np.maximum(a, 0.0) ** 2, 2.0 * np.maximum(a, 0.0)
    else:
        gate, up = np.split(a, 2, axis=-1)
        sig = 1.0 / (1.0 + np.exp(-gate))
        act = gate * sig * up
    y = act @ w2.T + b2
    dact = dy @ w2
    if activation == "swiglu":
        da = np.concatenate([dact * up * sig * (1.0 + gate * (1.0 - sig)), dact * gate * sig], -1)
    else:
        da = dact * dact_da
    return y, da @ w1, da, act


@pytest.mark.parametrize("norm,activation",
                         [("layernorm", "gelu"), ("rmsnorm", "swiglu"), (None, "srelu")])
@pytest.mark.parametrize("recipe", [None, "fp8-delayed"])
def test_an_mlp_is_the_norm_fc1_activation_fc2(rng, norm, activation, recipe):
    """octet.MLP (LayerNormMLP) and every gradient against NumPy in float64; under delayed scaling
    the second step fuses the norm's, the activation's and the activation gradient's FP8 casts.
    FP8's bounds: E4M3 inputs and weights in two GEMMs forward (a few percent), E5M2 gradients
    through two dgrads backward (4-7% each)."""
    mlp = octet.MLP(64, 48, activation=activation, norm=norm, seed=5)
    fc1, fc2 = mlp.fc1, mlp.fc2
    assert (fc1.in_features, fc1.out_features) == (64, 96 if activation == "swiglu" else 48)
    assert (fc2.in_features, fc2.out_features, fc2.norm) == (48, 64, None)
    if norm:
        fc1.norm_weight[:] = rng.uniform(0.5, 1.5, 64)
    gamma = fc1.norm_weight.copy() if norm else None
    beta = fc1.norm_bias.copy() if norm == "layernorm" else None
    w1, b1, w2, b2 = (v.astype(np.float64) for v in (fc1.weight, fc1.bias, fc2.weight, fc2.bias))
    x = rng.uniform(-2, 2, (2, 16, 64)).astype(np.float32)
    dy = rng.uniform(-0.1, 0.1, (2, 16, 64)).astype(np.float32)
    if norm:
        h, xhat, dx_of = norm_reference(x, norm, gamma, beta, 1e-5)
    else:
        h, xhat, dx_of = x.astype(np.float64), None, lambda g: g
    h2, dy2 = h.reshape(-1, 64), dy.reshape(-1, 64).astype(np.float64)
    y_ref, dh, da, act = mlp_reference(h2, activation, w1, b1, w2, b2, dy2)
    reg = octet.Registry()
    for _ in range(2):
        mlp.zero_grad()
        with octet.fp8_autocast(octet.Recipe.from_name(recipe) if recipe else None,
                                enabled=recipe is not None, registry=reg):
            y, record = mlp.forward(x)
        dx = mlp.backward(dy, record)
        if recipe:
            reg.finalize_backward()
    fwd, bwd = (1e-5, 1e-5) if recipe is None else (0.08, 0.15)
    assert y.shape == x.shape and dx.shape == x.shape
    assert rel_l2(y.reshape(-1, 64), y_ref) < fwd
    assert rel_l2(dx.reshape(-1, 64), dx_of(dh.reshape(x.shape)).reshape(-1, 64)) < bwd
    for got, ref in ((fc2.grad_weight, dy2.T @ act), (fc2.grad_bias, dy2.sum(0)),
                     (fc1.grad_weight, da.T @ h2), (fc1.grad_bias, da.sum(0))):
        assert rel_l2(got, ref) < bwd
    if norm:
        assert rel_l2(fc1.view("grad_norm_weight"), (dh * xhat.reshape(-1, 64)).sum(0)) < bwd


def test_an_mlp_recomputes_bitwise_and_spends_its_record_in_backward(rng):
    recipe = octet.Recipe.delayed(amax_history_len=4)
    mlp = octet.MLP(64, 64, activation="swiglu", norm="layernorm", seed=9)
    x = rng.uniform(-1, 1, (32, 64)).astype(np.float32)
    dy = rng.uniform(-1, 1, (32, 64)).astype(np.float32)
    reg = octet.Registry()
    for _ in range(2):
        with octet.fp8_autocast(recipe, registry=reg):
            y, record = mlp.forward(x)
        mlp.zero_grad(on_next_write=True)
        dx = mlp.backward(dy, record)
        reg.finalize_backward()
    grads = [layer.view(n).copy() for layer, n in
             ((mlp.fc1, "grad_weight"), (mlp.fc1, "grad_norm_weight"), (mlp.fc2, "grad_weight"))]
    with pytest.raises(octet.OctetValueError, match="released"):
        mlp.backward(dy, record)  # spent by the backward above
    _, released = mlp.forward(x)  # outside autocast: no FP8 state touched
    released.release_activations()
    with pytest.raises(octet.OctetValueError, match="released"):
        mlp.backward(dy, released)
    del released
    y2, again = mlp.forward(x, mode="recompute", original=record)
    mlp.zero_grad(on_next_write=True)
    dx2 = mlp.backward(dy, again)
    assert y.tobytes() == y2.tobytes() and dx.tobytes() == dx2.tobytes()
    for layer_name, grad in zip(("fc1.grad_weight", "fc1.grad_norm_weight", "fc2.grad_weight"),
                                grads):
        layer, name = layer_name.split(".")
        assert grad.tobytes() == getattr(mlp, layer).view(name).tobytes(), layer_name
    # The layers keep the MLP's memory alive; the MLP goes when the last of them does.
    fc1 = mlp.fc1
    alive = weakref.ref(mlp)
    del mlp, record, again
    gc.collect()
    assert alive() is None and fc1.weight.shape == (128, 64)


def test_bad_mlps_raise(rng):
    with pytest.raises(octet.OctetValueError, match="activation"):
        octet.MLP(16, 16, activation="tanh")
    with pytest.raises(octet.OctetValueError, match="must be positive"):
        octet.MLP(16, 0)
    mlp = octet.MLP(32, 16)
    with pytest.raises(octet.OctetValueError, match=r"expects \[\.\.\., 32\]"):
        mlp.forward(rng.uniform(-1, 1, (16, 16)).astype(np.float32))
    lin = octet.Linear(32, 32)
    _, lin_record = lin.forward(rng.uniform(-1, 1, (16, 32)).astype(np.float32))
    with pytest.raises(octet.OctetValueError, match="another MLP"):
        mlp.backward(np.zeros((16, 32), np.float32), lin_record)


# ------------------------------------------------------------------------------------------------
# Bad input: a Python exception with octet's message, never a crash, never a silent copy


def test_bad_tensors_raise(x):
    with pytest.raises(octet.OctetValueError, match="contiguous"):
        octet.quantize(x.T)  # a transposed view: octet never copies it
    with pytest.raises(octet.OctetError, match="i32"):
        octet.quantize(np.ones((4, 4), np.int32))
    with pytest.raises(octet.OctetError, match="f16|float16|dtype"):
        octet.quantize(np.ones((4, 4), np.float16))
    with pytest.raises(TypeError, match="DLPack"):
        octet.quantize([[1.0, 2.0]])
    with pytest.raises(octet.OctetValueError, match="pass no scale"):
        octet.quantize(x, mode="block_1x128", scale=np.ones(1, np.float32))
    with pytest.raises(octet.OctetValueError, match="mode"):
        octet.quantize(x, mode="per_row")
    q = octet.quantize(x)
    with pytest.raises(octet.OctetValueError, match="no transposed copy"):
        octet.dequantize(q, transposed=True)
    with pytest.raises(octet.OctetError, match=r"\[300, 37\]"):
        octet.dequantize(q, out=np.empty((COLS, ROWS), np.float32))


def test_bad_linear_calls_raise(rng):
    lin = octet.Linear(64, 32, seed=5)
    x = rng.uniform(-1, 1, (8, 64)).astype(np.float32)
    with pytest.raises(octet.OctetError, match="64"):
        lin.forward(np.ones((8, 32), np.float32))
    with pytest.raises(octet.OctetError, match="i32"):
        lin.forward(np.ones((8, 64), np.int32))
    with pytest.raises(octet.OctetValueError, match="contiguous"):
        lin.forward(np.asfortranarray(np.ones((8, 64), np.float32)))
    with pytest.raises(octet.OctetValueError, match="record of a forward"):
        lin.backward(np.ones((8, 32), np.float32), None)  # backward without a forward
    _, inference = lin.forward(x, mode="inference")
    with pytest.raises(octet.OctetValueError, match="inference"):
        lin.backward(np.ones((8, 32), np.float32), inference)
    _, record = lin.forward(x)
    with pytest.raises(octet.OctetError, match="grad_output"):
        lin.backward(np.ones((8, 16), np.float32), record)
    with pytest.raises(octet.OctetValueError, match="another Linear"):
        octet.Linear(64, 32).backward(np.ones((8, 32), np.float32), record)
    with pytest.raises(octet.OctetValueError, match="original"):
        lin.forward(x, mode="recompute")
    with pytest.raises(octet.OctetValueError, match="compute_dtype"):
        octet.Linear(4, 4, dtype="e4m3")
    with pytest.raises(octet.OctetValueError, match="device"):
        octet.Linear(4, 4, device="tpu")
    built, gpus = octet.cuda_info()
    if gpus == 0:
        with pytest.raises(octet.OctetError, match="cuda:0"):
            octet.Linear(4, 4, device="cuda:0")


def test_the_input_of_a_forward_is_kept_alive_without_a_copy(rng):
    lin = octet.Linear(16, 16, seed=2)
    x = rng.uniform(-1, 1, (16, 16)).astype(np.float32)
    refs = sys.getrefcount(x)
    _, record = lin.forward(x)
    assert sys.getrefcount(x) == refs + 1  # octet holds the array itself (f32 compute keeps it)
    del record
    assert sys.getrefcount(x) == refs


def test_forward_consumes_a_capsule_also_when_the_call_fails(rng):
    lin = octet.Linear(16, 8, seed=4)
    x = rng.uniform(-1, 1, (4, 16)).astype(np.float32)
    capsule = x.__dlpack__()
    y, _ = lin.forward(capsule)
    assert "used_dltensor" in repr(capsule)
    np.testing.assert_array_equal(y, lin.forward(x)[0])
    bad = np.ones((4, 8), np.float32)
    refs = sys.getrefcount(bad)
    capsule = bad.__dlpack__()
    assert sys.getrefcount(bad) == refs + 1
    with pytest.raises(octet.OctetError, match="16"):
        lin.forward(capsule)
    assert "used_dltensor" in repr(capsule)
    assert sys.getrefcount(bad) == refs  # octet ran the deleter once


class _Producer:
    """Hands a given capsule to numpy.from_dlpack."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


def test_an_output_is_handed_on_once_and_its_capsule_owns_it():
    lin = octet.Linear(16, 8, seed=4)
    w = lin.weight.copy()
    exported = lin.view("weight", convert=lambda e: e)
    assert exported.__dlpack_device__() == (1, 0)
    capsule = exported.__dlpack__()
    with pytest.raises(BufferError):
        exported.__dlpack__()
    with pytest.raises(BufferError):
        exported.to_numpy()
    unused = lin.view("bias", convert=lambda e: e.__dlpack__())
    del lin, unused  # the unconsumed capsule releases its tensor; the other keeps the weight
    np.testing.assert_array_equal(np.from_dlpack(_Producer(capsule)), w)


def test_modules_and_their_records_are_freed():
    lin = octet.Linear(16, 16, seed=4)
    x = np.ones((16, 16), np.float32)
    with octet.fp8_autocast(octet.Recipe.delayed(), registry=octet.Registry()):
        y, record = lin.forward(x)
    lin.backward(np.ones((16, 16), np.float32), record)
    refs = sys.getrefcount(x)
    _, held = lin.forward(x)  # an f32 record holds its input itself
    assert sys.getrefcount(x) == refs + 1
    alive = weakref.ref(lin)
    del lin, record, y, held
    gc.collect()
    assert alive() is None and sys.getrefcount(x) == refs


def test_api_version():
    major, minor, library = octet.api_version()
    assert (major, minor) == (1, 2) and library
