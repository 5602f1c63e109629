"""octet from Python: FP8 recipes, fp8_autocast, quantize/dequantize/gemm on DLPack tensors, and
octet.torch.Linear (PyTorch is optional: import octet.torch only when you use it).

Built over octet's C API (liboctet_c) through ctypes; README.md ("Python and C") says how."""
from __future__ import annotations

import contextlib
import ctypes
import threading

from . import _lib
from ._lib import OctetError, OctetMemoryError, OctetValueError

__all__ = ["Recipe", "fp8_autocast", "quantize", "dequantize", "gemm", "QuantizedTensor",
           "Registry", "OctetError", "OctetValueError", "OctetMemoryError", "cuda_info",
           "api_version"]

_DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2, "e4m3": 3, "e5m2": 4, "e8m0": 5}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_MODES = {"per_tensor": 0, "block_1x128": 1, "block_128x128": 2, "mxfp8_1x32": 3}
_MODE_NAMES = {v: k for k, v in _MODES.items()}
_FORMATS = {"e4m3": 0, "hybrid": 1}
_ALGOS = {"max": 0, "most_recent": 1}


def _enum(table, value, what):
    try:
        return table[value]
    except KeyError:
        raise OctetValueError(f"{what}: expected one of {sorted(table)}, got {value!r}") from None


def api_version():
    """(C API major, minor, octet library version)."""
    return _lib.version()


def cuda_info():
    """(built with CUDA, visible GPU count)."""
    built, count = ctypes.c_int(), ctypes.c_int()
    _lib.call("octet_cuda_info", ctypes.byref(built), ctypes.byref(count))
    return bool(built.value), count.value


# ------------------------------------------------------------------------------------------------
# Streams and tensors


def _stream_of(tensor, stream):
    """The CUDA stream for a call on `tensor`: the one given, PyTorch's current stream for a
    torch CUDA tensor, else the legacy default stream (0). Ignored on the CPU."""
    if stream is not None:
        return int(stream)
    dev = getattr(tensor, "__dlpack_device__", None)
    if dev is None or dev()[0] != _lib.KDLCUDA:
        return 0
    mod = type(tensor).__module__
    if mod.startswith("torch"):
        return _lib.torch_current_stream(tensor.device.index)
    if mod.startswith("cupy"):
        import cupy
        return cupy.cuda.get_current_stream().ptr
    return 0


class _Borrowed:
    """A DLPack tensor borrowed for one call: its capsule stays alive (and owns it) until then;
    ptr is its DLTensor's address."""

    __slots__ = ("capsule", "ptr")

    def __init__(self, obj, stream=None):
        self.capsule = _lib.capsule_of(obj, stream)
        self.ptr = _lib.managed_pointer(self.capsule)


def _borrow(obj, stream=None):
    return None if obj is None else _Borrowed(obj)


def _ptr(b):
    return None if b is None else b.ptr


def _to_array(exported: _lib.Exported):
    """An exported tensor as NumPy (CPU) or PyTorch (CUDA) array, without a copy."""
    if exported._fields[1] == _lib.KDLCPU:
        return exported.to_numpy()
    import torch
    return torch.from_dlpack(exported.__dlpack__())  # already ordered on the call's stream


def _empty_like_device(shape, dtype_name, reference):
    """A new array on reference's device: NumPy on the CPU, else PyTorch (or CuPy)."""
    dev = reference.__dlpack_device__()
    if dev[0] == _lib.KDLCPU:
        import numpy
        if dtype_name == "bfloat16":
            raise OctetValueError("a bfloat16 output on the CPU needs an `out` tensor (NumPy has no bfloat16)")
        return numpy.empty(shape, dtype=dtype_name)
    try:
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype_name), device=f"cuda:{dev[1]}")
    except ImportError:
        import cupy
        with cupy.cuda.Device(dev[1]):
            return cupy.empty(shape, dtype=dtype_name)


# ------------------------------------------------------------------------------------------------
# Recipes and autocast


class Recipe:
    """An FP8 recipe (Transformer Engine's defaults). Build with Recipe.delayed(), .current(),
    .block() or .mxfp8()."""

    def __init__(self, handle):
        self._handle = handle

    @classmethod
    def _make(cls, fn, *args):
        out = ctypes.c_void_p()
        _lib.call(fn, *args, ctypes.byref(out))
        return cls(out)

    @classmethod
    def delayed(cls, margin=0, amax_history_len=1024, amax_compute_algo="max", fp8_format="hybrid"):
        return cls._make("octet_recipe_delayed", int(margin), int(amax_history_len),
                         _enum(_ALGOS, amax_compute_algo, "amax_compute_algo"),
                         _enum(_FORMATS, fp8_format, "fp8_format"))

    @classmethod
    def current(cls, power_of_2_scales=False, fp8_format="hybrid"):
        return cls._make("octet_recipe_current", int(bool(power_of_2_scales)),
                         _enum(_FORMATS, fp8_format, "fp8_format"))

    @classmethod
    def block(cls):
        return cls._make("octet_recipe_block")

    @classmethod
    def mxfp8(cls):
        return cls._make("octet_recipe_mxfp8")

    @classmethod
    def from_name(cls, name):
        return cls._make("octet_recipe_from_name", str(name).encode())

    @property
    def name(self):
        out = ctypes.c_char_p()
        _lib.call("octet_recipe_name", self._handle, ctypes.byref(out))
        return out.value.decode()

    @property
    def fields(self):
        v = [ctypes.c_int() for _ in range(6)]
        _lib.call("octet_recipe_fields", self._handle, *[ctypes.byref(x) for x in v])
        kind, fmt, margin, history, algo, p2 = (x.value for x in v)
        return {"kind": ["delayed", "current", "block", "mxfp8"][kind],
                "fp8_format": ["e4m3", "hybrid"][fmt], "margin": margin,
                "amax_history_len": history, "amax_compute_algo": ["max", "most_recent"][algo],
                "power_of_2_scales": bool(p2)}

    def __repr__(self):
        return f"octet.Recipe({self.name}, {self.fields})"

    def __del__(self):
        if getattr(self, "_handle", None):
            _lib.lib.octet_recipe_destroy(self._handle)
            self._handle = None


class Registry:
    """The FP8 states finalized together once per pass (octet's AmaxRegistry)."""

    def __init__(self):
        self._handle = ctypes.c_void_p()
        _lib.call("octet_registry_create", ctypes.byref(self._handle))

    def finalize_backward(self):
        status = _lib.registry_finalize_backward(self._handle)
        if status:
            _lib.fail(status)

    @property
    def update_counts(self):
        f, b = ctypes.c_int64(), ctypes.c_int64()
        _lib.call("octet_registry_update_counts", self._handle, ctypes.byref(f), ctypes.byref(b))
        return f.value, b.value

    def __del__(self):
        if getattr(self, "_handle", None):
            _lib.lib.octet_registry_destroy(self._handle)
            self._handle = None


class _Local(threading.local):
    def __init__(self):
        self.registry = None
        self.scopes = []  # the open fp8_autocast scopes, innermost last


_local = _Local()


def default_registry() -> Registry:
    """This thread's registry, used by fp8_autocast when none is given."""
    if _local.registry is None:
        _local.registry = Registry()
    return _local.registry


class _Scope:
    """What an open fp8_autocast holds (octet.torch reads it)."""

    __slots__ = ("recipe", "registry", "first_module")

    def __init__(self, recipe, registry):
        self.recipe, self.registry = recipe, registry
        self.first_module = None  # the first module forward in the scope ends the backward pass


def active_scope():
    stack = _local.scopes
    return stack[-1] if stack else None


class fp8_autocast(contextlib.ContextDecorator):
    """Modules run their GEMMs in FP8 under `recipe` (default: Recipe.delayed()) in this block;
    its end finalizes the forward pass (amax history and scales), once. Reusable and reentrant:
    what a scope holds lives on this thread's stack of scopes, not in the object."""

    __slots__ = ("_recipe", "_enabled", "_registry")

    def __init__(self, recipe: Recipe | None = None, enabled: bool = True,
                 registry: Registry | None = None):
        self._recipe, self._enabled, self._registry = recipe, enabled, registry

    def __enter__(self):
        if not self._enabled:
            return None
        recipe = self._recipe if self._recipe is not None else Recipe.delayed()
        registry = self._registry if self._registry is not None else default_registry()
        status = _lib.autocast_enter(recipe._handle, registry._handle)
        if status:
            _lib.fail(status)
        _local.scopes.append(_Scope(recipe, registry))
        return None

    def __exit__(self, *exc):
        if self._enabled:
            _local.scopes.pop()
            status = _lib.autocast_exit()
            if status:
                _lib.fail(status)
        return False


# ------------------------------------------------------------------------------------------------
# Quantization and GEMM


class QuantizedTensor:
    """FP8 codes with their scales (row-wise and/or transposed copy), owned by octet."""

    def __init__(self, handle):
        self._handle = handle
        dtype, mode, rows, cols, rw, cw = (ctypes.c_int(), ctypes.c_int(), ctypes.c_int64(),
                                           ctypes.c_int64(), ctypes.c_int(), ctypes.c_int())
        _lib.call("octet_qtensor_info", handle, *[ctypes.byref(v) for v in (dtype, mode, rows, cols, rw, cw)])
        self.dtype = _DTYPE_NAMES[dtype.value]
        self.mode = _MODE_NAMES[mode.value]
        self.shape = (rows.value, cols.value)
        self.has_rowwise, self.has_columnwise = bool(rw.value), bool(cw.value)

    def _view(self, fn, transposed, stream):
        out = ctypes.c_void_p()
        _lib.call(fn, self._handle, int(transposed), stream or 0, ctypes.byref(out))
        return _to_array(_lib.Exported(out.value))

    def data(self, transposed=False, stream=None):
        """The FP8 codes as uint8, [rows, cols] (or [cols, rows] transposed); no copy."""
        return self._view("octet_qtensor_data", transposed, stream)

    def scale_inv(self, transposed=False, stream=None):
        """The scales' inverses (float32; uint8 E8M0 codes for MXFP8); no copy."""
        return self._view("octet_qtensor_scale_inv", transposed, stream)

    def __repr__(self):
        return f"octet.QuantizedTensor({self.dtype}, {self.mode}, shape={self.shape})"

    def __del__(self):
        if getattr(self, "_handle", None):
            _lib.lib.octet_qtensor_destroy(self._handle)
            self._handle = None


def quantize(x, dtype="e4m3", mode="per_tensor", scale=None, amax=None, rowwise=True,
             columnwise=False, power_of_2_scales=None, stream=None) -> QuantizedTensor:
    """Quantizes the [rows, cols] matrix view of x (float32/bfloat16, any DLPack tensor, used in
    place). per_tensor: q = fp8(x * scale) with `scale` an f32[1] tensor on x's device, or current
    scaling (fp8_max / max|x|) when scale is None. amax: optional f32[>=1], updated in place."""
    opts = _lib.QuantizeOptions()
    _lib.lib.octet_quantize_options_init(ctypes.byref(opts))
    opts.dtype = _enum(_DTYPES, dtype, "dtype")
    opts.mode = _enum(_MODES, mode, "mode")
    opts.rowwise, opts.columnwise = int(bool(rowwise)), int(bool(columnwise))
    if power_of_2_scales is not None:
        opts.power_of_2_scales = int(bool(power_of_2_scales))
    xb, sb, ab = _Borrowed(x), _borrow(scale), _borrow(amax)
    opts.scale, opts.amax = _ptr(sb), _ptr(ab)
    out = ctypes.c_void_p()
    _lib.call("octet_quantize", xb.ptr, ctypes.byref(opts), _stream_of(x, stream), ctypes.byref(out))
    return QuantizedTensor(out)


def dequantize(q: QuantizedTensor, out=None, dtype="float32", transposed=False, stream=None):
    """out = the dequantized row-wise (or transposed) copy of q; allocated when not given."""
    if out is None:
        rows, cols = q.shape
        shape = (cols, rows) if transposed else (rows, cols)
        out = _empty_like_device(shape, dtype, q.data(transposed))
    ob = _Borrowed(out)
    _lib.call("octet_dequantize", q._handle, int(bool(transposed)), ob.ptr, _stream_of(out, stream))
    return out


def gemm(a: QuantizedTensor, b: QuantizedTensor, out=None, bias=None, alpha=1.0, beta=0.0,
         a_transposed=False, b_transposed=False, fast_accum=False, stream=None):
    """out [M, N] = alpha * A [M, K] @ B [N, K]^T + beta * out + bias, with A and B the row-wise
    (or transposed) copies of FP8 tensors (the TN layout of Hopper's FP8 tensor cores)."""
    if out is None:
        m = a.shape[1] if a_transposed else a.shape[0]
        n = b.shape[1] if b_transposed else b.shape[0]
        out = _empty_like_device((m, n), "float32", a.data(a_transposed))
    ob, bb = _Borrowed(out), _borrow(bias)
    _lib.call("octet_gemm_fp8", a._handle, int(bool(a_transposed)), b._handle,
              int(bool(b_transposed)), _ptr(bb), ob.ptr, float(alpha), float(beta),
              int(bool(fast_accum)), _stream_of(out, stream))
    return out


# ------------------------------------------------------------------------------------------------
# Linear (framework-free; octet.torch.Linear wraps it in a torch.nn.Module)

_FORWARD_MODES = {"training": 0, "recompute": 1, "inference": 2}
_LINEAR_TENSORS = {"weight": 0, "bias": 1, "grad_weight": 2, "grad_bias": 3, "norm_weight": 4,
                   "norm_bias": 5, "grad_norm_weight": 6, "grad_norm_bias": 7}
_NORMS = {"layernorm": 1, "rmsnorm": 2}  # none: 0


def _parse_device(device):
    if isinstance(device, _lib.DLDevice):
        return device
    text = str(device)
    if text == "cpu":
        return _lib.DLDevice(_lib.KDLCPU, 0)
    if text == "cuda" or text.startswith("cuda:"):
        return _lib.DLDevice(_lib.KDLCUDA, int(text[5:]) if text.startswith("cuda:") else 0)
    raise OctetValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class Record:
    """What a Linear forward keeps for backward (octet's Saved), freed with this object."""

    __slots__ = ("handle", "owner", "done", "__weakref__")

    def __init__(self, handle, owner):
        self.handle, self.owner, self.done = handle, owner, False

    def release_activations(self):
        """Keeps only what recomputing this forward needs (Linear.forward(mode='recompute'))."""
        _lib.call("octet_saved_release_activations", self.handle)

    def __del__(self):
        if getattr(self, "handle", None):
            _lib.lib.octet_saved_destroy(self.handle)
            self.handle = None


class Linear:
    """octet's Linear with explicit forward and backward over DLPack tensors:
    y, record = lin.forward(x); dx = lin.backward(dy, record). Gradients accumulate until
    zero_grad(). Outputs come back as NumPy arrays on the CPU, PyTorch tensors on a GPU (or pass
    `convert`, a function of a DLPack object).

    norm='layernorm' or 'rmsnorm' puts a norm over in_features before the GEMM (Transformer
    Engine's LayerNormLinear): y = norm(x) W^T + b, its gamma (ones) and beta (zeros, LayerNorm)
    in FP32 with epsilon `eps`; under delayed scaling the norm writes the GEMM's FP8 input itself."""

    def __init__(self, in_features, out_features, bias=True, device="cpu", dtype="float32", seed=0,
                 norm=None, eps=1e-5):
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.device = _parse_device(device)
        self.norm = norm
        self._handle = ctypes.c_void_p()
        _lib.call("octet_linear_create_normed", self.in_features, self.out_features,
                  int(bool(bias)), 0 if norm is None else _enum(_NORMS, norm, "norm"),
                  float(eps), self.device,
                  int(seed), _enum(_DTYPES, dtype, "dtype"), ctypes.byref(self._handle))
        self.has_bias = bool(bias)
        self._owner = None

    # The C calls forward and backward make (octet.MLP reuses both methods with its own).
    _forward_c, _backward_c = _lib.linear_forward, _lib.linear_backward

    @classmethod
    def _layer_of(cls, mlp, index):
        """Layer `index` (0: fc1, which carries the norm; 1: fc2) of an octet.MLP, which owns it."""
        self = cls.__new__(cls)
        self._handle = ctypes.c_void_p()
        _lib.call("octet_mlp_linear", mlp._handle, index, ctypes.byref(self._handle))
        self._owner = mlp._owned  # the layer lives as long as the MLP's handle
        in_f, out_f, bias, device = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int(), _lib.DLDevice()
        _lib.call("octet_linear_info", self._handle, ctypes.byref(in_f), ctypes.byref(out_f),
                  ctypes.byref(bias), ctypes.byref(device))
        norm = ctypes.c_int()
        _lib.call("octet_linear_norm_info", self._handle, ctypes.byref(norm), None)
        self.in_features, self.out_features = in_f.value, out_f.value
        self.has_bias, self.device = bool(bias.value), device
        self.norm = {v: k for k, v in _NORMS.items()}.get(norm.value)
        return self

    def forward(self, x, mode="training", original: Record | None = None, stream=None,
                convert=_to_array):
        """y [..., out] = x [..., in] W^T + b. x is used in place and kept (no copy) until the
        returned record is freed. x may also be a "dltensor" capsule (which this consumes)."""
        m = _FORWARD_MODES.get(mode)
        if m is None:
            _enum(_FORWARD_MODES, mode, "mode")  # raises
        stream = _stream_of(x, stream)  # before the capsule is consumed: nothing raises after
        capsule = _lib.capsule_of(x)
        y, saved = ctypes.c_void_p(), ctypes.c_void_p()
        status = self._forward_c(self._handle, _lib.consume(capsule), m,
                                 original.handle if original is not None else None, stream,
                                 ctypes.byref(y), ctypes.byref(saved))
        if status:
            _lib.fail(status)
        return convert(_lib.Exported(y.value)), Record(saved, self)

    def backward(self, dy, record: Record, stream=None, convert=_to_array):
        """dx from dy; adds to the weight and bias gradients."""
        stream = _stream_of(dy, stream)
        capsule = _lib.capsule_of(dy)  # kept (owning dy's export) until the call returns
        dx = ctypes.c_void_p()
        status = self._backward_c(self._handle, _lib.managed_pointer(capsule),
                                  record.handle if record is not None else None, stream,
                                  ctypes.byref(dx))
        if status:
            _lib.fail(status)
        if record is not None:
            record.done = True
        return convert(_lib.Exported(dx.value))

    def view(self, which, stream=None, convert=_to_array):
        """A view (no copy) of 'weight', 'bias', 'grad_weight' or 'grad_bias' (float32); with a
        norm also 'norm_weight' (gamma), 'norm_bias' (beta) and their 'grad_' views."""
        out = ctypes.c_void_p()
        _lib.call("octet_linear_tensor_view", self._handle, _enum(_LINEAR_TENSORS, which, "which"),
                  stream or 0, ctypes.byref(out))
        return convert(_lib.Exported(out.value))

    weight = property(lambda self: self.view("weight"))
    bias = property(lambda self: self.view("bias") if self.has_bias else None)
    grad_weight = property(lambda self: self.view("grad_weight"))
    grad_bias = property(lambda self: self.view("grad_bias") if self.has_bias else None)
    norm_weight = property(lambda self: self.view("norm_weight") if self.norm else None)
    norm_bias = property(lambda self: self.view("norm_bias") if self.norm == "layernorm" else None)

    def zero_grad(self, on_next_write=False, stream=None):
        _lib.call("octet_linear_zero_grad", self._handle, int(bool(on_next_write)), stream or 0)

    def weights_updated(self):
        """Call after changing the weights in place: the next forward casts them again."""
        _lib.call("octet_linear_weights_updated", self._handle)

    def fp8_state(self, recipe: Recipe, stream=None, convert=_to_array):
        """{name: copy} of the FP8 state for `recipe` (created when absent), for checkpoints."""
        state = {}
        for i, name in enumerate(self._state_names(recipe)):
            out = ctypes.c_void_p()
            _lib.call("octet_linear_fp8_state_get", self._handle, recipe._handle, i, stream or 0,
                      ctypes.byref(out))
            state[name] = convert(_lib.Exported(out.value))
        return state

    def load_fp8_state(self, recipe: Recipe, state, stream=None):
        """Copies a state from fp8_state() back in (any device, float32, the same shapes)."""
        names = self._state_names(recipe)
        missing = [n for n in names if n not in state]
        if missing:
            raise OctetValueError(f"load_fp8_state: missing {missing}")
        for i, name in enumerate(names):
            b = _Borrowed(state[name])
            _lib.call("octet_linear_fp8_state_set", self._handle, recipe._handle, i, b.ptr,
                      stream or 0)

    def _state_names(self, recipe):
        count = ctypes.c_int()
        _lib.call("octet_linear_fp8_state_count", self._handle, recipe._handle, ctypes.byref(count))
        names = []
        for i in range(count.value):
            name = ctypes.c_char_p()
            _lib.call("octet_linear_fp8_state_name", i, ctypes.byref(name))
            names.append(name.value.decode())
        return names

    @property
    def fp8_update_counts(self):
        f, b = ctypes.c_int64(), ctypes.c_int64()
        _lib.call("octet_linear_fp8_update_counts", self._handle, ctypes.byref(f), ctypes.byref(b))
        return f.value, b.value

    def __del__(self):
        if getattr(self, "_handle", None) and getattr(self, "_owner", None) is None:
            _lib.lib.octet_linear_destroy(self._handle)
        self._handle = None


_ACTIVATIONS = {"gelu": 0, "swiglu": 1, "srelu": 2}


class MLP:
    """octet's MLP with explicit forward and backward (Transformer Engine's LayerNormMLP):
    y = fc2(act(fc1(norm(x)))) for x [..., hidden], fc1 hidden -> ffn (2 ffn for 'swiglu', [gate |
    up]), fc2 ffn -> hidden, activation 'gelu' (tanh), 'swiglu' or 'srelu'; norm 'layernorm',
    'rmsnorm' or None. y, record = mlp.forward(x); dx = mlp.backward(dy, record), which spends the
    record's activations (a recompute forward rebuilds them). Under delayed scaling the norm
    writes fc1's FP8 input and the activation fc2's. The layers are octet.Linear objects, mlp.fc1
    (with the norm's parameters) and mlp.fc2: views, gradients and FP8 state go through them."""

    def __init__(self, hidden, ffn, bias=True, activation="gelu", norm="layernorm", eps=1e-5,
                 device="cpu", dtype="float32", seed=0):
        self.hidden, self.ffn = int(hidden), int(ffn)
        self.activation, self.norm = activation, norm
        self.device = _parse_device(device)
        # The handle is freed when neither this object nor its layers use it (no reference cycle,
        # so it goes as soon as the last of them does).
        self._owned = _SharedHandle(_lib.lib.octet_mlp_destroy)
        self._handle = self._owned.handle
        _lib.call("octet_mlp_create", self.hidden, self.ffn, int(bool(bias)),
                  _enum(_ACTIVATIONS, activation, "activation"),
                  0 if norm is None else _enum(_NORMS, norm, "norm"), float(eps), self.device,
                  int(seed), _enum(_DTYPES, dtype, "dtype"), ctypes.byref(self._handle))
        self.fc1, self.fc2 = Linear._layer_of(self, 0), Linear._layer_of(self, 1)

    _forward_c, _backward_c = _lib.mlp_forward, _lib.mlp_backward
    forward = Linear.forward
    backward = Linear.backward

    def zero_grad(self, on_next_write=False, stream=None):
        self.fc1.zero_grad(on_next_write, stream)
        self.fc2.zero_grad(on_next_write, stream)

    def weights_updated(self):
        self.fc1.weights_updated()
        self.fc2.weights_updated()


class _SharedHandle:
    """A C handle that `destroy` frees when the last Python object holding this goes."""

    __slots__ = ("handle", "destroy")

    def __init__(self, destroy):
        self.handle, self.destroy = ctypes.c_void_p(), destroy

    def __del__(self):
        if self.handle:
            self.destroy(self.handle)
            self.handle = None


__all__ += ["Linear", "MLP", "Record", "default_registry", "active_scope"]
