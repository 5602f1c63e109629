"""ctypes bindings of liboctet_c (include/octet/octet.h) and the DLPack capsule plumbing."""
from __future__ import annotations

import ctypes
import os
import pathlib
import struct

# ------------------------------------------------------------------------------------------------
# DLPack (dlpack.h 0.6): tensors themselves are read from memory below (_MANAGED)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


KDLCPU, KDLCUDA = 1, 2


class QuantizeOptions(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int),
        ("mode", ctypes.c_int),
        ("rowwise", ctypes.c_int),
        ("columnwise", ctypes.c_int),
        ("power_of_2_scales", ctypes.c_int),
        ("scale", ctypes.c_void_p),  # const DLTensor*
        ("amax", ctypes.c_void_p),
    ]


# ------------------------------------------------------------------------------------------------
# Errors


class OctetError(RuntimeError):
    """An octet call failed; the message is octet's (what was expected, what was received)."""


class OctetValueError(OctetError, ValueError):
    """A bad argument: a wrong dtype, device, shape, layout, handle or enum value."""


class OctetMemoryError(OctetError, MemoryError):
    """octet ran out of host or device memory."""


_ERRORS = {1: OctetValueError, 2: OctetError, 3: OctetMemoryError}

# ------------------------------------------------------------------------------------------------
# The library


def _library_path() -> str:
    """OCTET_C_LIBRARY (e.g. a build tree's liboctet_c.so), else the copy installed with us."""
    env = os.environ.get("OCTET_C_LIBRARY")
    if env:
        return env
    here = pathlib.Path(__file__).resolve().parent
    for candidate in sorted(here.glob("lib*/liboctet_c.so*")) + sorted(here.glob("liboctet_c.so*")):
        return str(candidate)
    raise ImportError(
        "octet: liboctet_c.so was not found next to the package; install it with "
        "`pip install ./python`, or point OCTET_C_LIBRARY at a built one "
        "(e.g. build/liboctet_c.so)")


lib = ctypes.CDLL(_library_path())

lib.octet_version.argtypes = [ctypes.POINTER(ctypes.c_int)] * 2 + [ctypes.POINTER(ctypes.c_char_p)]
lib.octet_version.restype = None


def version():
    major, minor, lib_version = ctypes.c_int(), ctypes.c_int(), ctypes.c_char_p()
    lib.octet_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(lib_version))
    return major.value, minor.value, lib_version.value.decode()


# The C API this package calls: major 1, with octet_linear_create_normed (minor 1) and octet_mlp_*
# (minor 2). Checked before any of its functions is looked up, so an older library gets this
# message, not an AttributeError.
_API_MAJOR, _API_MINOR = 1, 2
_major, _minor, _ = version()
if _major != _API_MAJOR or _minor < _API_MINOR:
    raise ImportError(
        f"octet: {lib._name} has C API {_major}.{_minor}; this package needs "
        f"{_API_MAJOR}.{_API_MINOR} or a later {_API_MAJOR}.x: rebuild the library or "
        "reinstall with `pip install ./python`")

_c = ctypes
_p = ctypes.c_void_p  # handles, streams, and tensors passed by address (a DLTensor is at offset 0)
_pp = ctypes.POINTER(ctypes.c_void_p)
_i64p = ctypes.POINTER(ctypes.c_int64)
_intp = ctypes.POINTER(ctypes.c_int)
_strp = ctypes.POINTER(ctypes.c_char_p)

_SIGNATURES = {
    "octet_recipe_delayed": [_c.c_int, _c.c_int, _c.c_int, _c.c_int, _pp],
    "octet_recipe_current": [_c.c_int, _c.c_int, _pp],
    "octet_recipe_block": [_pp],
    "octet_recipe_mxfp8": [_pp],
    "octet_recipe_from_name": [_c.c_char_p, _pp],
    "octet_recipe_name": [_p, _strp],
    "octet_recipe_fields": [_p, _intp, _intp, _intp, _intp, _intp, _intp],
    "octet_cuda_info": [_intp, _intp],
    "octet_registry_create": [_pp],
    "octet_registry_destroy": [_p],
    "octet_registry_finalize_backward": [_p],
    "octet_registry_update_counts": [_p, _i64p, _i64p],
    "octet_autocast_enter": [_p, _p],
    "octet_autocast_exit": [],
    "octet_quantize": [_p, ctypes.POINTER(QuantizeOptions), _p, _pp],
    "octet_dequantize": [_p, _c.c_int, _p, _p],
    "octet_qtensor_info": [_p, _intp, _intp, _i64p, _i64p, _intp, _intp],
    "octet_qtensor_data": [_p, _c.c_int, _p, _pp],
    "octet_qtensor_scale_inv": [_p, _c.c_int, _p, _pp],
    "octet_gemm_fp8": [_p, _c.c_int, _p, _c.c_int, _p, _p, _c.c_float, _c.c_float, _c.c_int, _p],
    "octet_linear_create": [_c.c_int64, _c.c_int64, _c.c_int, DLDevice, _c.c_uint64, _c.c_int,
                            _pp],
    "octet_linear_create_normed": [_c.c_int64, _c.c_int64, _c.c_int, _c.c_int, _c.c_float,
                                   DLDevice, _c.c_uint64, _c.c_int, _pp],
    "octet_linear_info": [_p, _i64p, _i64p, _intp, ctypes.POINTER(DLDevice)],
    "octet_linear_norm_info": [_p, _intp, ctypes.POINTER(ctypes.c_float)],
    "octet_linear_forward": [_p, _p, _c.c_int, _p, _p, _pp, _pp],
    "octet_linear_backward": [_p, _p, _p, _p, _pp],
    "octet_saved_release_activations": [_p],
    "octet_linear_zero_grad": [_p, _c.c_int, _p],
    "octet_linear_weights_updated": [_p],
    "octet_linear_tensor_view": [_p, _c.c_int, _p, _pp],
    "octet_linear_fp8_state_count": [_p, _p, _intp],
    "octet_linear_fp8_state_name": [_c.c_int, _strp],
    "octet_linear_fp8_state_get": [_p, _p, _c.c_int, _p, _pp],
    "octet_linear_fp8_state_set": [_p, _p, _c.c_int, _p, _p],
    "octet_linear_fp8_update_counts": [_p, _i64p, _i64p],
    "octet_mlp_create": [_c.c_int64, _c.c_int64, _c.c_int, _c.c_int, _c.c_int, _c.c_float,
                         DLDevice, _c.c_uint64, _c.c_int, _pp],
    "octet_mlp_info": [_p, _i64p, _i64p, _intp],
    "octet_mlp_linear": [_p, _c.c_int, _pp],
    "octet_mlp_forward": [_p, _p, _c.c_int, _p, _p, _pp, _pp],
    "octet_mlp_backward": [_p, _p, _p, _p, _pp],
}
for _name, _args in _SIGNATURES.items():
    _f = getattr(lib, _name)
    _f.argtypes = _args
    _f.restype = ctypes.c_int

for _name in ("octet_recipe_destroy", "octet_qtensor_destroy", "octet_linear_destroy",
              "octet_saved_destroy", "octet_mlp_destroy"):
    getattr(lib, _name).argtypes = [_p]
    getattr(lib, _name).restype = None
lib.octet_last_error.argtypes = []
lib.octet_last_error.restype = ctypes.c_char_p
lib.octet_autocast_depth.argtypes = []
lib.octet_autocast_depth.restype = ctypes.c_int
lib.octet_quantize_options_init.argtypes = [ctypes.POINTER(QuantizeOptions)]
lib.octet_quantize_options_init.restype = None


_FUNCTIONS = {name: getattr(lib, name) for name in _SIGNATURES}


def fail(status: int):
    """Raises the OctetError of a failed status, with octet's message."""
    message = lib.octet_last_error().decode("utf-8", "replace")
    raise _ERRORS.get(status, OctetError)(message)


def call(name: str, *args) -> None:
    """Calls lib.<name>; a failed status raises the matching OctetError with octet's message."""
    status = _FUNCTIONS[name](*args)
    if status:
        fail(status)


# The calls of a training step, bound once (`if status: fail(status)` after each): no lookup by
# name, no argument tuple.
linear_forward = lib.octet_linear_forward
linear_backward = lib.octet_linear_backward
mlp_forward = lib.octet_mlp_forward
mlp_backward = lib.octet_mlp_backward
autocast_enter = lib.octet_autocast_enter
autocast_exit = lib.octet_autocast_exit
registry_finalize_backward = lib.octet_registry_finalize_backward

# ------------------------------------------------------------------------------------------------
# DLPack capsules (Python's C API through ctypes.pythonapi). Tensors travel as addresses (ints):
# a capsule's DLManagedTensor, whose dl_tensor is at offset 0, is read with one struct unpack.

_DLTENSOR = b"dltensor"
_USED = b"used_dltensor"
_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api = ctypes.pythonapi
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api))
_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 _CapsuleDestructor)(("PyCapsule_New", _api))
# The destructor sees the capsule as a raw PyObject*, hence these take addresses.
_is_valid_raw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_get_pointer_raw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))

# DLManagedTensor: data, device type and id, ndim, dtype code, bits and lanes, shape, strides,
# byte_offset, manager_ctx, deleter.
_MANAGED = struct.Struct("=QiiiBBHQQQQQ")
_MAX_NDIM = 8
_SHAPES = [struct.Struct(f"={n}q") for n in range(_MAX_NDIM + 1)]
_Memory = ctypes.c_char * max(_MANAGED.size, _SHAPES[-1].size)  # a window that unpack_from reads
_Release = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_releases = {}  # deleter address -> callable


def _fields(addr: int):
    return _MANAGED.unpack_from(_Memory.from_address(addr))


def _shape(addr: int, ndim: int):
    if ndim > _MAX_NDIM:
        return struct.unpack(f"={ndim}q", ctypes.string_at(addr, 8 * ndim))
    return _SHAPES[ndim].unpack_from(_Memory.from_address(addr)) if ndim else ()


def _run_deleter(addr: int, deleter: int):
    if deleter:
        fn = _releases.get(deleter) or _releases.setdefault(deleter, _Release(deleter))
        fn(addr)


def release(addr: int):
    """Runs the deleter of the DLManagedTensor at `addr` (if it has one)."""
    _run_deleter(addr, _fields(addr)[11])


@_CapsuleDestructor
def _capsule_destructor(capsule):
    # A capsule nobody consumed still owns its tensor (DLPack's rule).
    if _is_valid_raw(capsule, _DLTENSOR):
        release(_get_pointer_raw(capsule, _DLTENSOR))


_torch_exports = None


def torch_exports():
    """(to_dlpack, raw current stream of a device index) from PyTorch, looked up on first use (the
    package works without PyTorch). Both skip Python-level work: Tensor.__dlpack__'s stream
    handshake, which octet does not need (it orders every call on the stream it is given), and
    the torch.cuda.Stream object that torch.cuda.current_stream builds."""
    global _torch_exports
    if _torch_exports is None:
        import torch
        try:
            from torch._C import _cuda_getCurrentRawStream as raw_stream
        except ImportError:
            def raw_stream(index):
                return torch.cuda.current_stream(index).cuda_stream
        _torch_exports = (torch.utils.dlpack.to_dlpack, raw_stream)
    return _torch_exports


def torch_current_stream(device_index) -> int:
    """PyTorch's current stream on a CUDA device."""
    return torch_exports()[1](device_index)


def capsule_of(obj, stream=None):
    """A "dltensor" capsule for any DLPack producer (or a capsule itself). A PyTorch tensor with no
    stream given is exported without __dlpack__'s stream handshake: octet then runs on PyTorch's
    current stream (the package's _stream_of), the stream its data was made on."""
    if type(obj).__name__ == "PyCapsule":
        return obj
    if stream is None and type(obj).__module__.startswith("torch"):
        return torch_exports()[0](obj)
    try:
        export = obj.__dlpack__
    except AttributeError:
        raise TypeError(f"octet: expected a DLPack tensor (NumPy, PyTorch, CuPy, ...), got "
                        f"{type(obj).__name__}") from None
    return export() if stream is None else export(stream=stream)


def managed_pointer(capsule) -> int:
    """The address of the capsule's DLManagedTensor (also that of its DLTensor)."""
    return _get_pointer(capsule, _DLTENSOR)


def consume(capsule) -> int:
    """The capsule's tensor, now owned by the callee (the capsule is marked used)."""
    addr = _get_pointer(capsule, _DLTENSOR)
    _set_name(capsule, _USED)
    return addr


class _Owned:
    """Owns the DLManagedTensor at _addr (None once handed on): its deleter runs at the end."""

    __slots__ = ("_addr", "_fields")

    def __init__(self, addr: int, fields=None):
        self._addr = addr
        self._fields = _fields(addr) if fields is None else fields

    def __del__(self):
        addr, self._addr = self._addr, None
        if addr is not None:
            _run_deleter(addr, self._fields[11])


class Exported(_Owned):
    """A tensor octet handed out: give it to numpy.from_dlpack / torch.from_dlpack (no copy)."""

    __slots__ = ()

    def __dlpack_device__(self):
        return self._fields[1], self._fields[2]

    def _take(self) -> int:
        addr, self._addr = self._addr, None
        if addr is None:
            raise BufferError("octet: this tensor was already exported once")
        return addr

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        # The stream is not needed: octet's call already ordered the tensor on the one it was given.
        return _new_capsule(self._take(), _DLTENSOR, _capsule_destructor)

    def to_numpy(self):
        """A writable NumPy array over a CPU tensor, owning it (numpy.from_dlpack marks arrays
        from a DLPack 0.6 capsule read-only, and octet's weight views are meant to be written)."""
        return _numpy().asarray(_HostArray(self._take(), self._fields))


def _numpy():
    global _numpy_module
    if _numpy_module is None:
        import numpy
        _numpy_module = numpy
    return _numpy_module


_numpy_module = None

# NumPy type strings by (DLPack code, bits); bfloat16 has none in NumPy: its bits come as uint16.
_TYPESTR = {(2, 32): "<f4", (2, 16): "<f2", (4, 16): "<u2", (1, 8): "|u1", (1, 16): "<u2",
            (0, 32): "<i4", (0, 64): "<i8"}


class _HostArray(_Owned):
    """Owns an exported CPU tensor and shows it to NumPy through __array_interface__."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr, fields):
        super().__init__(addr, fields)
        data, _, _, ndim, code, bits, _, shape = fields[:8]
        self.__array_interface__ = {
            "shape": _shape(shape, ndim),
            "typestr": _TYPESTR[(code, bits)],
            "data": (data, False),
            "version": 3,
        }
