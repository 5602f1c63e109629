"""ctypes bindings of liboctet_c (include/octet/octet.h) and the DLPack capsule plumbing."""
from __future__ import annotations

import ctypes
import os
import pathlib

# ------------------------------------------------------------------------------------------------
# DLPack structs (dlpack.h 0.6; a DLManagedTensorVersioned embeds the same DLTensor)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

KDLCPU, KDLCUDA = 1, 2


class QuantizeOptions(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int),
        ("mode", ctypes.c_int),
        ("rowwise", ctypes.c_int),
        ("columnwise", ctypes.c_int),
        ("power_of_2_scales", ctypes.c_int),
        ("scale", ctypes.POINTER(DLTensor)),
        ("amax", ctypes.POINTER(DLTensor)),
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

_c = ctypes
_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_dlp = ctypes.POINTER(DLTensor)
_mtp = ctypes.POINTER(DLManagedTensor)
_mtpp = ctypes.POINTER(_mtp)
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
    "octet_quantize": [_dlp, ctypes.POINTER(QuantizeOptions), _p, _pp],
    "octet_dequantize": [_p, _c.c_int, _dlp, _p],
    "octet_qtensor_info": [_p, _intp, _intp, _i64p, _i64p, _intp, _intp],
    "octet_qtensor_data": [_p, _c.c_int, _p, _mtpp],
    "octet_qtensor_scale_inv": [_p, _c.c_int, _p, _mtpp],
    "octet_gemm_fp8": [_p, _c.c_int, _p, _c.c_int, _dlp, _dlp, _c.c_float, _c.c_float, _c.c_int,
                       _p],
    "octet_linear_create": [_c.c_int64, _c.c_int64, _c.c_int, DLDevice, _c.c_uint64, _c.c_int,
                            _pp],
    "octet_linear_info": [_p, _i64p, _i64p, _intp, ctypes.POINTER(DLDevice)],
    "octet_linear_forward": [_p, _mtp, _c.c_int, _p, _p, _mtpp, _pp],
    "octet_linear_backward": [_p, _dlp, _p, _p, _mtpp],
    "octet_saved_release_activations": [_p],
    "octet_linear_zero_grad": [_p, _c.c_int, _p],
    "octet_linear_weights_updated": [_p],
    "octet_linear_tensor_view": [_p, _c.c_int, _p, _mtpp],
    "octet_linear_fp8_state_count": [_p, _p, _intp],
    "octet_linear_fp8_state_name": [_c.c_int, _strp],
    "octet_linear_fp8_state_get": [_p, _p, _c.c_int, _p, _mtpp],
    "octet_linear_fp8_state_set": [_p, _p, _c.c_int, _dlp, _p],
    "octet_linear_fp8_update_counts": [_p, _i64p, _i64p],
}
for _name, _args in _SIGNATURES.items():
    _f = getattr(lib, _name)
    _f.argtypes = _args
    _f.restype = ctypes.c_int

for _name in ("octet_recipe_destroy", "octet_qtensor_destroy", "octet_linear_destroy",
              "octet_saved_destroy"):
    getattr(lib, _name).argtypes = [_p]
    getattr(lib, _name).restype = None
lib.octet_last_error.argtypes = []
lib.octet_last_error.restype = ctypes.c_char_p
lib.octet_autocast_depth.argtypes = []
lib.octet_autocast_depth.restype = ctypes.c_int
lib.octet_quantize_options_init.argtypes = [ctypes.POINTER(QuantizeOptions)]
lib.octet_quantize_options_init.restype = None
lib.octet_version.argtypes = [_intp, _intp, _strp]
lib.octet_version.restype = None


_FUNCTIONS = {name: getattr(lib, name) for name in _SIGNATURES}


def call(name: str, *args) -> None:
    """Calls lib.<name>; a failed status raises the matching OctetError with octet's message."""
    status = _FUNCTIONS[name](*args)
    if status != 0:
        message = lib.octet_last_error().decode("utf-8", "replace")
        raise _ERRORS.get(status, OctetError)(message)


# ------------------------------------------------------------------------------------------------
# DLPack capsules (Python's C API through ctypes.pythonapi)

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_api.PyCapsule_New.restype = ctypes.py_object

_DLTENSOR = b"dltensor"
_USED = b"used_dltensor"
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


@_CapsuleDestructor
def _capsule_destructor(capsule):
    # A capsule nobody consumed still owns its tensor (DLPack's rule).
    if _api.PyCapsule_IsValid(capsule, _DLTENSOR):
        ptr = _get_pointer(capsule, _DLTENSOR)
        managed = ctypes.cast(ptr, _mtp)
        if managed.contents.deleter:
            managed.contents.deleter(managed)


def capsule_of(obj, stream=None):
    """A "dltensor" capsule for any DLPack producer (or a capsule itself)."""
    if type(obj).__name__ == "PyCapsule":
        return obj
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"octet: expected a DLPack tensor (NumPy, PyTorch, CuPy, ...), got {type(obj).__name__}")
    if stream is not None:
        return obj.__dlpack__(stream=stream)
    return obj.__dlpack__()


def managed_pointer(capsule) -> "ctypes._Pointer":
    return ctypes.cast(_api.PyCapsule_GetPointer(capsule, _DLTENSOR), _mtp)


def consume(capsule) -> "ctypes._Pointer":
    """The capsule's tensor, now owned by the callee (the capsule is marked used)."""
    ptr = managed_pointer(capsule)
    _api.PyCapsule_SetName(capsule, _USED)
    return ptr


class Exported:
    """A tensor octet handed out: give it to numpy.from_dlpack / torch.from_dlpack (no copy)."""

    __slots__ = ("_managed", "_device")

    def __init__(self, managed):
        self._managed = managed
        d = managed.contents.dl_tensor.device
        self._device = (d.device_type, d.device_id)

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if self._managed is None:
            raise BufferError("octet: this tensor was already exported once")
        managed, self._managed = self._managed, None
        return _api.PyCapsule_New(ctypes.cast(managed, ctypes.c_void_p), _DLTENSOR,
                                  _capsule_destructor)

    def to_numpy(self):
        """A writable NumPy array over a CPU tensor, owning it (numpy.from_dlpack marks arrays
        from a DLPack 0.6 capsule read-only, and octet's weight views are meant to be written)."""
        import numpy

        holder = _HostArray(self._managed)
        self._managed = None
        return numpy.asarray(holder)

    def __del__(self):
        if self._managed is not None and self._managed.contents.deleter:
            self._managed.contents.deleter(self._managed)
            self._managed = None


# NumPy type strings by (DLPack code, bits); bfloat16 has none in NumPy: its bits come as uint16.
_TYPESTR = {(2, 32): "<f4", (2, 16): "<f2", (4, 16): "<u2", (1, 8): "|u1", (1, 16): "<u2",
            (0, 32): "<i4", (0, 64): "<i8"}


class _HostArray:
    """Owns an exported CPU tensor and shows it to NumPy through __array_interface__."""

    def __init__(self, managed):
        self._managed = managed
        t = managed.contents.dl_tensor
        self.__array_interface__ = {
            "shape": tuple(t.shape[i] for i in range(t.ndim)),
            "typestr": _TYPESTR[(t.dtype.code, t.dtype.bits)],
            "data": (t.data or 0, False),
            "version": 3,
        }

    def __del__(self):
        if self._managed is not None and self._managed.contents.deleter:
            self._managed.contents.deleter(self._managed)
            self._managed = None


def out_managed():
    return _mtp()


def version():
    major, minor, lib_version = ctypes.c_int(), ctypes.c_int(), ctypes.c_char_p()
    lib.octet_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(lib_version))
    return major.value, minor.value, lib_version.value.decode()
