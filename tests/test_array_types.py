"""Outputs in the caller's array type, and ragvit.Buffer, the outputs ragvit allocates itself.

Every op that allocates is called without out= on arrays of one library and must return that
library's arrays with the values the NumPy path computes (the same C backend on the CPU, the
float64 reference for attention): array_api_strict and JAX on the CPU; CuPy (on the default
and on a non-default stream), JAX and Numba (through the CUDA Array Interface) on the GPU.
NumPy stays NumPy. A producer with neither an allocator nor __array_namespace__ gets the
ragvit.Buffer itself, which must round-trip through numpy.from_dlpack and torch.from_dlpack
without a copy, honour stream=, max_version=, dl_device= and copy= as the array API standard
says, outlive the inputs and be freed when its last consumer goes.
"""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
import tracemalloc
import types
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from support.checks import check_attention
from support.devices import requires_cuda

import ragvit

kDLCPU, kDLCUDA = 1, 2

# ---- the ops that allocate, on small float32 problems ----


def _problems(rng, **kw) -> dict:
    """op name -> (call(arrays) -> result, dict of NumPy inputs); kw goes to every op."""

    def floats(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    cu = np.array([0, 2, 5], np.int32)
    q = floats(10, 2, 32)
    return {
        "attention": (lambda a: ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"], **kw),
                      {"q": q, "k": floats(10, 2, 32), "v": floats(10, 2, 32),
                       "cu_seqlens": np.array([0, 4, 10], np.int32)}),
        "pack": (lambda a: ragvit.pack(a["x"], a["keep"], **kw),
                 {"x": floats(2, 3, 4), "keep": np.array([[1, 0, 1], [1, 1, 0]], bool)}),
        "unpack": (lambda a: ragvit.unpack(a["packed"], a["cu_seqlens"], 4, **kw),
                   {"packed": floats(5, 4), "cu_seqlens": cu}),
        "gather_prefix": (lambda a: ragvit.gather_prefix(a["packed"], a["cu_seqlens"], 1, **kw),
                          {"packed": floats(5, 4), "cu_seqlens": cu}),
        "segment_mean": (lambda a: ragvit.segment_mean(a["packed"], a["cu_seqlens"], **kw),
                         {"packed": floats(5, 4), "cu_seqlens": cu}),
        "repack": (lambda a: ragvit.repack(a["packed"], a["cu_seqlens"], a["keep"], **kw),
                   {"packed": floats(5, 4), "cu_seqlens": cu,
                    "keep": np.array([1, 0, 1, 1, 0], bool)}),
        "linear": (lambda a: ragvit.linear(a["x"], a["weight"], a["bias"], **kw),
                   {"x": floats(5, 8), "weight": floats(3, 8), "bias": floats(3)}),
        "layer_norm": (lambda a: ragvit.layer_norm(a["x"], a["weight"], a["bias"], **kw),
                       {"x": floats(5, 8), "weight": floats(8), "bias": floats(8)}),
        "gelu": (lambda a: ragvit.gelu(a["x"], **kw), {"x": floats(5, 8)}),
        "topk_index": (lambda a: ragvit.topk_index(a["scores"], 2, prefix=1, **kw),
                       {"scores": floats(2, 6)}),
    }


OPS = list(_problems(np.random.default_rng(0)))


def _rng(seed):
    return np.random.default_rng(seed % 2**63)


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def _check_same(got, expected, *, exact: bool, note: str = ""):
    """got (NumPy) equals expected: bit for bit when exact, else within fp32 rounding."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, note
    if exact or expected.dtype.kind in "biu":
        np.testing.assert_array_equal(got, expected, err_msg=note)
    else:
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5, err_msg=note)


class DLPackOnly:
    """A producer with __dlpack__ and nothing else: no allocator, no __array_namespace__."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)


def _host_buffer(shape=(5, 8), dtype=torch.float32):
    """A host ragvit.Buffer holding gelu(x), and x."""
    x = torch.randn(shape).to(dtype)
    out = ragvit.gelu(DLPackOnly(x))
    assert isinstance(out, ragvit.Buffer)
    return out, x


# ---- array_api_strict and NumPy on the CPU ----


@pytest.mark.parametrize("op", OPS)
def test_array_api_strict_inputs_get_array_api_strict_outputs(op, seed):
    xp = pytest.importorskip("array_api_strict")
    call, inputs = _problems(_rng(seed))[op]
    expected = _as_tuple(call(inputs))
    got = _as_tuple(call({name: xp.asarray(a) for name, a in inputs.items()}))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert type(g) is type(xp.asarray(0)), f"{op}: got {type(g).__name__}"
        _check_same(np.from_dlpack(g), e, exact=True, note=f"{op}, seed={seed}")


@pytest.mark.parametrize("op", OPS)
def test_numpy_inputs_get_numpy_outputs(op, seed):
    call, inputs = _problems(_rng(seed))[op]
    for result in _as_tuple(call(inputs)):
        assert type(result) is np.ndarray, f"{op}: got {type(result).__name__}"


@pytest.mark.parametrize("op", OPS)
def test_jax_cpu_inputs_get_jax_outputs(op, seed):
    """JAX arrays on the CPU come back as JAX arrays on the CPU (through
    jax.numpy.from_dlpack, their namespace's), equal to the NumPy path's."""
    jax = pytest.importorskip("jax")
    cpu = jax.devices("cpu")[0]
    was_x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)  # topk_index returns int64, pack int64 indices
    try:
        call, inputs = _problems(_rng(seed))[op]
        expected = _as_tuple(call(inputs))
        got = _as_tuple(call({name: jax.device_put(a, cpu) for name, a in inputs.items()}))
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert isinstance(g, jax.Array), f"{op}: got {type(g).__name__}"
            assert g.devices() == {cpu}
            _check_same(np.asarray(g), e, exact=True, note=f"{op}, seed={seed}")
    finally:
        jax.config.update("jax_enable_x64", was_x64)


def test_array_api_strict_attention_matches_the_reference(seed):
    xp = pytest.importorskip("array_api_strict")
    _, inputs = _problems(_rng(seed))["attention"]
    args = [xp.asarray(inputs[n]) for n in ("q", "k", "v", "cu_seqlens")]
    out = ragvit.attention(*args)
    q, k, v, cu = (torch.from_numpy(inputs[n]) for n in ("q", "k", "v", "cu_seqlens"))
    check_attention(torch.from_numpy(np.from_dlpack(out)), q, k, v, cu, seed=seed)


@pytest.mark.parametrize("op", OPS)
def test_producers_without_a_namespace_get_a_buffer(op, seed):
    call, inputs = _problems(_rng(seed))[op]
    expected = _as_tuple(call(inputs))
    got = _as_tuple(call({name: DLPackOnly(a) for name, a in inputs.items()}))
    for g, e in zip(got, expected, strict=True):
        assert isinstance(g, ragvit.Buffer)
        assert g.shape == e.shape and g.ndim == e.ndim and g.dtype == e.dtype.name
        _check_same(np.from_dlpack(g), e, exact=True, note=f"{op}, seed={seed}")


def test_a_buffer_is_read_back_directly_by_the_next_op():
    x = torch.randn(5, 8)
    h = ragvit.gelu(DLPackOnly(x))
    y = ragvit.layer_norm(h)  # a Buffer argument: the first array decides the output type
    assert isinstance(y, ragvit.Buffer)
    expected = ragvit.layer_norm(ragvit.gelu(x))
    assert torch.equal(torch.from_dlpack(y), expected)


# ---- ragvit.Buffer: round trips, protocols, refusals ----


def test_buffer_round_trips_through_numpy_without_a_copy():
    buf, x = _host_buffer()
    expected = ragvit.gelu(x).numpy()
    a = np.from_dlpack(buf)
    np.testing.assert_array_equal(a, expected)
    interface = buf.__array_interface__
    assert interface["version"] == 3 and interface["typestr"] == "<f4"
    assert interface["shape"] == (5, 8) and interface["strides"] is None
    assert a.ctypes.data == interface["data"][0], "numpy.from_dlpack copied"
    b = np.asarray(buf)  # through __array_interface__
    assert b.ctypes.data == interface["data"][0] and b.flags.writeable
    a[0, 0] = 42.0
    assert b[0, 0] == 42.0


def test_buffer_round_trips_through_torch_without_a_copy():
    buf, x = _host_buffer()
    t = torch.from_dlpack(buf)
    assert torch.equal(t, ragvit.gelu(x))
    assert t.data_ptr() == buf.__array_interface__["data"][0], "torch.from_dlpack copied"
    assert t.data_ptr() % 64 == 0, "host buffers are 64-byte aligned"


def test_bfloat16_buffers_export_through_dlpack_only():
    buf, x = _host_buffer(dtype=torch.bfloat16)
    assert buf.dtype == "bfloat16"
    assert not hasattr(buf, "__array_interface__")
    assert not hasattr(buf, "__cuda_array_interface__")
    assert torch.equal(torch.from_dlpack(buf), ragvit.gelu(x))


def test_outputs_come_back_through_the_defining_package_without_a_namespace(monkeypatch):
    """A type without __array_namespace__ whose package has from_dlpack (CuPy's ndarray):
    the output comes back through that package's from_dlpack; a package without one gives
    the Buffer itself."""
    import sys
    import types

    package = types.ModuleType("ragvit_fakepkg")
    received = []

    def from_dlpack(buffer):
        received.append(buffer)
        return ("wrapped", buffer)

    package.from_dlpack = from_dlpack
    monkeypatch.setitem(sys.modules, "ragvit_fakepkg", package)
    Wrapped = type("Wrapped", (DLPackOnly,), {"__module__": "ragvit_fakepkg.core"})
    Plain = type("Plain", (DLPackOnly,), {"__module__": "ragvit_fakepkg_missing.core"})
    x = torch.randn(3, 4)
    tag, buf = ragvit.gelu(Wrapped(x))
    assert tag == "wrapped" and received == [buf] and isinstance(buf, ragvit.Buffer)
    torch.testing.assert_close(torch.from_dlpack(buf), torch.nn.functional.gelu(x))
    assert isinstance(ragvit.gelu(Plain(x)), ragvit.Buffer)


# ---- CuPy outputs, built in C: the construction, with a stand-in CuPy ----


def _fake_cupy(has_extension_base: bool):
    """A stand-in `cupy` module whose constructors record their calls: an ndarray with the
    public constructor, or (has_extension_base) CuPy's own layout, a Python ndarray whose
    __new__ calls its extension base's _init (ragvit calls _init itself). A constructor
    named in module.failing raises."""
    calls, failing = [], set()

    def fail_if(name):
        if name in failing:
            raise OSError(f"{name} failed")

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            fail_if("UnownedMemory")
            calls.append(("UnownedMemory", ptr, size, owner, device_id))
            self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            fail_if("MemoryPointer")
            calls.append(("MemoryPointer", mem, offset))
            self.mem, self.ptr = mem, mem.ptr + offset

    def init(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        calls.append(("init", shape, dtype, memptr, strides, order))
        self.shape, self.dtype, self.data = shape, dtype, memptr
        fail_if("init")  # after the half-made array took memptr

    if has_extension_base:
        base = type("_ndarray_base", (), {"_init": init})

        def new(cls, *args, **kwargs):
            calls.append(("__new__",))
            x = super(ndarray, cls).__new__(cls)
            x._init(*args, **kwargs)
            return x

        ndarray = type("ndarray", (base,), {"__module__": "cupy", "__new__": new})
    else:
        ndarray = type("ndarray", (), {"__module__": "cupy", "__init__": init})

    def get_current_stream(device_id=-1):
        raise AssertionError("_cupy_ndarray touches no stream")

    cuda = types.SimpleNamespace(UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
                                 get_current_stream=get_current_stream)
    module = types.ModuleType("cupy")
    module.ndarray, module.cuda, module.failing = ndarray, cuda, failing
    return module, calls


@pytest.mark.parametrize("layout", ["constructor", "extension_base"])
def test_cupy_outputs_are_built_over_the_buffer(layout, monkeypatch):
    """The array is ndarray(shape, dtype, memptr=MemoryPointer(UnownedMemory(ptr, nbytes,
    buffer, device), 0)), with a NumPy dtype object and CuPy's default (compact) strides; CuPy's
    layout with an extension base skips the Python __new__; the array holds the Buffer."""
    fake, calls = _fake_cupy(layout == "extension_base")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    like = object.__new__(fake.ndarray)
    buf, _ = _host_buffer()
    ptr = buf.__array_interface__["data"][0]
    array = ragvit._C._cupy_ndarray(buf, like)
    assert type(array) is fake.ndarray
    unowned, memptr, made = calls
    assert unowned[:3] == ("UnownedMemory", ptr, 5 * 8 * 4) and unowned[3] is buf
    assert unowned[4] == 0
    assert memptr[0] == "MemoryPointer" and memptr[1] is array.data.mem and memptr[2] == 0
    assert made[0] == "init" and made[1] == (5, 8) and made[3] is array.data
    assert type(made[2]) is type(np.dtype(np.float32)) and made[2] == np.float32
    assert made[4:] == (None, "C"), "compact outputs take CuPy's default strides"
    calls.clear()
    for dtype, op, source in ((np.int64, lambda a: ragvit.topk_index(a, 2), np.float32),
                              (np.float16, ragvit.gelu, np.float16)):
        out = op(DLPackOnly(np.ones((2, 6), source)))
        array_of = ragvit._C._cupy_ndarray(out, like)
        assert calls[-1][2] == dtype and array_of.shape == out.shape
    ref = weakref.ref(buf)
    del buf, unowned, memptr, made, array_of, out
    calls.clear()
    gc.collect()
    assert ref() is not None, "the array must hold its Buffer"
    del array
    gc.collect()
    assert ref() is None


def test_cupy_route_skips_what_it_cannot_build(monkeypatch):
    """bfloat16 (no NumPy dtype) and arguments that are no cupy.ndarray: None, no call."""
    fake, calls = _fake_cupy(True)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    like = object.__new__(fake.ndarray)
    buf16, _ = _host_buffer(dtype=torch.bfloat16)
    assert ragvit._C._cupy_ndarray(buf16, like) is None
    buf, _ = _host_buffer()
    other = type("ndarray", (), {"__module__": "numpy_like"})()
    assert ragvit._C._cupy_ndarray(buf, other) is None
    assert ragvit._C._cupy_ndarray(buf, np.ones(2)) is None
    assert calls == []
    with pytest.raises(TypeError, match="buffer must be a ragvit.Buffer"):
        ragvit._C._cupy_ndarray(np.ones(2), like)


@pytest.mark.parametrize("layout", ["constructor", "extension_base"])
@pytest.mark.parametrize("failing", ["UnownedMemory", "MemoryPointer", "init"])
def test_cupy_construction_errors_propagate_and_release_the_buffer(layout, failing,
                                                                   monkeypatch):
    """An exception from any of CuPy's constructors propagates, and whatever was built
    before it (the half-made array included) lets go of the Buffer."""
    fake, calls = _fake_cupy(layout == "extension_base")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    like = object.__new__(fake.ndarray)
    buf, _ = _host_buffer()
    assert type(ragvit._C._cupy_ndarray(buf, like)) is fake.ndarray  # resolved, then dropped
    calls.clear()
    gc.collect()
    count = sys.getrefcount(buf)
    fake.failing.add(failing)
    with pytest.raises(OSError, match=f"{failing} failed"):
        ragvit._C._cupy_ndarray(buf, like)
    calls.clear()
    gc.collect()
    assert sys.getrefcount(buf) == count, "an error path kept a reference to the Buffer"
    fake.failing.clear()
    assert type(ragvit._C._cupy_ndarray(buf, like)) is fake.ndarray


# ctypes functions the module state may point to after the test that resolved them
_STREAM_FUNCTIONS = []


def _stream_capsule(signature: bytes, stream_of):
    """A capsule named signature over a C function intptr_t (int) calling stream_of, as
    Cython exports CuPy's get_stream_ptr in cupy_backends.cuda.stream.__pyx_capi__."""
    function = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(stream_of)
    _STREAM_FUNCTIONS.append((function, signature))  # the capsule keeps pointers to both
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_char_p,
                                                   ctypes.c_void_p)
    return new(ctypes.cast(function, ctypes.c_void_p), signature, None)


def test_cupy_current_stream_is_read_for_the_buffers_device(monkeypatch):
    """CuPy's current stream on the device asked for: through the C function CuPy exports
    (its capsule's signature must be CuPy's), else cupy.cuda.get_current_stream(device).ptr,
    whose exception propagates."""
    buf, _ = _host_buffer()
    asked = []

    def current_stream(device_id=-1):
        asked.append(device_id)
        if device_id < 0:
            raise ValueError("no current device")
        return types.SimpleNamespace(ptr=1000 + device_id)

    for capsule, expected in ((None, 1003), (_stream_capsule(b"intptr_t (void)", abs), 1003),
                              (_stream_capsule(b"intptr_t (int)", lambda d: 2000 + d), 2003)):
        fake, calls = _fake_cupy(True)
        fake.cuda.get_current_stream = current_stream
        monkeypatch.setitem(sys.modules, "cupy", fake)
        backend = types.ModuleType("cupy_backends.cuda.stream")
        backend.__pyx_capi__ = {} if capsule is None else {"get_stream_ptr": capsule}
        monkeypatch.setitem(sys.modules, "cupy_backends.cuda.stream", backend)
        asked.clear()
        assert type(ragvit._C._cupy_ndarray(buf, object.__new__(fake.ndarray))) is fake.ndarray
        assert asked == [], "building the array touches no stream"
        assert ragvit._C._cupy_current_stream(3) == expected
        assert asked == ([3] if expected == 1003 else [])
    fake, _ = _fake_cupy(True)
    fake.cuda.get_current_stream = current_stream
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.delitem(sys.modules, "cupy_backends.cuda.stream")
    ragvit._C._cupy_ndarray(buf, object.__new__(fake.ndarray))
    with pytest.raises(ValueError, match="no current device"):
        ragvit._C._cupy_current_stream(-1)


def test_cupy_route_builds_real_cupy_arrays_without_a_gpu():
    """With CuPy installed, its own constructors over a host Buffer (no CUDA call is made:
    UnownedMemory is given the device)."""
    cupy = pytest.importorskip("cupy")
    buf, _ = _host_buffer((3, 20))
    ptr = buf.__array_interface__["data"][0]
    memory = cupy.cuda.UnownedMemory(ptr, 4, None, 0)
    like = cupy.ndarray((1,), np.float32, memptr=cupy.cuda.MemoryPointer(memory, 0))
    array = ragvit._C._cupy_ndarray(buf, like)
    assert type(array) is cupy.ndarray
    assert array.shape == (3, 20) and array.dtype == np.float32
    assert array.strides == (80, 4) and array.flags.c_contiguous
    assert array.data.ptr == ptr and array.data.mem.size == 3 * 20 * 4
    assert array.data.mem._owner is buf and array.data.device_id == 0
    public = cupy.ndarray(array.shape, array.dtype, memptr=array.data)  # CuPy's own __new__
    for name in ("strides", "size", "nbytes", "base", "_c_contiguous", "_f_contiguous",
                 "_index_32_bits"):
        assert getattr(array, name) == getattr(public, name), name
    del public
    ref = weakref.ref(buf)
    del buf
    gc.collect()
    assert ref() is not None
    del array
    gc.collect()
    assert ref() is None


_NO_CUPY_SCRIPT = """
import json, sys
import numpy as np, torch

attempts = []


class Watch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupy_backends"):
            attempts.append(name)
        return None


sys.meta_path.insert(0, Watch())
sys.path.insert(0, sys.argv[1])
import test_array_types as t  # noqa: E402

for op, (call, inputs) in t._problems(np.random.default_rng(0)).items():
    call(inputs)
    call({n: t.DLPackOnly(a) for n, a in inputs.items()})
    call({n: torch.from_numpy(a) for n, a in inputs.items()})
loaded = [m for m in sys.modules if m.split(".")[0] in ("cupy", "cupy_backends")]
print(json.dumps({"attempts": attempts, "loaded": loaded}))
"""


def test_no_op_looks_for_cupy_without_cupy_arrays():
    """Every allocating op on NumPy, torch and plain DLPack inputs, in a fresh interpreter:
    nothing imports cupy or asks an importer for it."""
    result = subprocess.run([sys.executable, "-c", _NO_CUPY_SCRIPT, str(Path(__file__).parent)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"attempts": [], "loaded": []}


def test_host_buffer_has_no_cuda_array_interface():
    buf, _ = _host_buffer()
    assert not hasattr(buf, "__cuda_array_interface__")
    assert buf.__dlpack_device__() == (kDLCPU, 0)
    assert repr(buf) == "ragvit.Buffer(shape=(5, 8), dtype=float32, device=cpu)"


_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


@pytest.mark.parametrize(
    "max_version, name, version",
    [
        (None, b"dltensor", None),
        ((0, 8), b"dltensor", None),
        ((1, 0), b"dltensor_versioned", (1, 0)),
        ((1, 1), b"dltensor_versioned", (1, 1)),
        ((1, 9), b"dltensor_versioned", (1, 3)),
        ((2, 0), b"dltensor_versioned", (1, 3)),
    ],
)
def test_dlpack_capsule_follows_max_version(max_version, name, version):
    buf, _ = _host_buffer()
    kwargs = {} if max_version is None else {"max_version": max_version}
    capsule = buf.__dlpack__(**kwargs)
    assert _capsule_name(capsule) == name
    if version is not None:  # DLManagedTensorVersioned opens with {uint32 major, minor}
        pair = (ctypes.c_uint32 * 2).from_address(_capsule_pointer(capsule, name))
        assert (pair[0], pair[1]) == version
    ref = weakref.ref(buf)
    del buf
    gc.collect()
    assert ref() is not None, "an unconsumed capsule must hold its buffer"
    del capsule
    gc.collect()
    assert ref() is None, "an unconsumed capsule must release its buffer"


def test_dlpack_accepts_the_standard_keywords_on_the_host():
    buf, _ = _host_buffer()
    for kwargs in ({"stream": None}, {"stream": -1}, {"dl_device": (kDLCPU, 0)},
                   {"copy": False}, {"copy": None}, {"dl_device": None}):
        assert _capsule_name(buf.__dlpack__(**kwargs)) == b"dltensor"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"stream": 0}, ValueError, r"stream must be None or -1 for a host buffer, got 0"),
        ({"stream": 7}, ValueError, r"stream must be None or -1 for a host buffer, got 7"),
        ({"stream": "s"}, TypeError, r"stream must be an int or None, got str"),
        ({"stream": True}, TypeError, r"stream must be an int or None, got bool"),
        ({"max_version": "1.0"}, TypeError, r"max_version must be None or a \(major, minor\)"),
        ({"max_version": (1,)}, TypeError, r"max_version must be None or a \(major, minor\)"),
        ({"max_version": (1, -1)}, TypeError, r"max_version must be None or a \(major, minor\)"),
        ({"dl_device": (kDLCUDA, 0)}, BufferError, r"dl_device must be the buffer's own device"),
        ({"dl_device": "cpu"}, BufferError, r"dl_device must be the buffer's own device"),
        ({"copy": True}, BufferError, r"copy must be None or False, got True"),
        ({"strean": None}, TypeError, r"unexpected keyword 'strean'"),
    ],
)
def test_dlpack_refusals(kwargs, error, match):
    buf, _ = _host_buffer()
    with pytest.raises(error, match=match):
        buf.__dlpack__(**kwargs)


def test_dlpack_refuses_positional_arguments():
    buf, _ = _host_buffer()
    with pytest.raises(TypeError, match="keyword arguments only"):
        buf.__dlpack__(None)


def test_buffer_cannot_be_made_by_hand():
    with pytest.raises(TypeError):
        ragvit.Buffer()


# ---- lifetimes ----


def test_buffer_is_freed_when_its_last_consumer_goes():
    buf, x = _host_buffer()
    expected = ragvit.gelu(x)
    ref = weakref.ref(buf)
    t = torch.from_dlpack(buf)
    a = np.from_dlpack(buf)
    del buf
    gc.collect()
    assert ref() is not None
    garbage = [torch.full((4096,), float("nan")) for _ in range(16)]  # reuse freed memory
    assert torch.equal(t, expected) and np.array_equal(a, expected.numpy())
    del t
    gc.collect()
    assert ref() is not None, "numpy's array still holds it"
    del a, garbage
    gc.collect()
    assert ref() is None


def test_output_outlives_its_inputs(seed):
    xp = pytest.importorskip("array_api_strict")
    call, inputs = _problems(_rng(seed))["attention"]
    expected = call(inputs)
    args = {name: xp.asarray(a.copy()) for name, a in inputs.items()}
    refs = [weakref.ref(a) for a in args.values()]
    result = call(args)
    del args
    gc.collect()
    assert all(r() is None for r in refs), "ragvit kept an input alive"
    garbage = [np.full(4096, np.nan, np.float32) for _ in range(16)]
    np.testing.assert_array_equal(np.from_dlpack(result), expected)
    del garbage


def test_namespace_cache_keeps_no_class_alive():
    xp = pytest.importorskip("array_api_strict")

    class Strict:
        """A user class whose namespace is array_api_strict's."""

        def __init__(self, array):
            self.array = xp.asarray(array)

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

        def __dlpack__(self, **kwargs):
            return self.array.__dlpack__(**kwargs)

        def __array_namespace__(self, api_version=None):
            return xp

    out = ragvit.gelu(Strict(np.ones((2, 3), np.float32)))
    assert type(out) is type(xp.asarray(0))
    ref = weakref.ref(Strict)
    del Strict
    gc.collect()
    assert ref() is None, "the namespace cache kept a user class alive"


def test_a_namespace_error_propagates():
    class Broken(DLPackOnly):
        def __array_namespace__(self, api_version=None):
            raise RuntimeError("no namespace today")

    with pytest.raises(RuntimeError, match="no namespace today"):
        ragvit.gelu(Broken(np.ones((2, 3), np.float32)))


def test_many_types_through_the_namespace_cache(seed):
    """More types than the cache holds, in turn: each still gets its own namespace."""
    xp = pytest.importorskip("array_api_strict")
    namespaces = []
    for i in range(12):
        fake = type(f"Fake{i}", (DLPackOnly,), {"__array_namespace__": lambda self, **k: xp})
        namespaces.append(fake)
    x = _rng(seed).standard_normal((3, 4)).astype(np.float32)
    for _ in range(2):
        for cls in namespaces + [DLPackOnly]:
            out = ragvit.gelu(cls(x))
            if cls is DLPackOnly:
                assert isinstance(out, ragvit.Buffer)
            else:
                assert type(out) is type(xp.asarray(0))


def test_ten_thousand_calls_leak_nothing(seed):
    xp = pytest.importorskip("array_api_strict")
    x = xp.asarray(_rng(seed).standard_normal((4, 8)).astype(np.float32))
    fake = DLPackOnly(np.ones((4, 8), np.float32))
    for _ in range(100):
        ragvit.gelu(x)
        ragvit.gelu(fake)
    counts = (sys.getrefcount(x), sys.getrefcount(fake))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(10_000):
            ragvit.gelu(x)
            ragvit.gelu(fake)
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert (sys.getrefcount(x), sys.getrefcount(fake)) == counts
    assert growth < 64 * 1024, f"traced memory grew by {growth} bytes over 10k calls"


# ---- CUDA (GPU machine) ----


def _cuda_problem_inputs(seed, to, **kw):
    """op -> (call, inputs converted by `to`, the NumPy path's results); kw goes to the ops
    on the converted inputs only."""
    host = _problems(_rng(seed))
    device = _problems(_rng(seed), **kw)
    return {op: (device[op][0], {n: to(a) for n, a in inputs.items()}, _as_tuple(call(inputs)))
            for op, (call, inputs) in host.items()}


def _cupy():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # a wheel without a usable driver
        pytest.skip(f"cupy has no CUDA device: {error}")
    return cupy


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("stream_kind", ["default", "non_default", "non_default_given"])
@pytest.mark.parametrize("op", OPS)
def test_cupy_inputs_get_cupy_outputs(op, stream_kind, seed):
    cupy = _cupy()
    stream = cupy.cuda.Stream.null if stream_kind == "default" else cupy.cuda.Stream(
        non_blocking=True)
    kw = {"stream": stream.ptr} if stream_kind == "non_default_given" else {}
    call, inputs, expected = _cuda_problem_inputs(seed, cupy.asarray, **kw)[op]
    cupy.cuda.Device().synchronize()
    with stream:
        got = _as_tuple(call(inputs))
    stream.synchronize()
    cupy.cuda.Device().synchronize()
    for g, e in zip(got, expected, strict=True):
        assert type(g) is cupy.ndarray, f"{op}: got {type(g).__name__}"
        memory = g.data.mem  # built over the Buffer in C, not through cupy.from_dlpack
        assert type(memory) is cupy.cuda.UnownedMemory, type(memory).__name__
        assert isinstance(memory._owner, ragvit.Buffer) and memory.ptr == g.data.ptr
        _check_same(cupy.asnumpy(g), e, exact=op in ("pack", "repack", "unpack",
                                                    "gather_prefix", "topk_index"),
                    note=f"{op}, {stream_kind}, seed={seed}")
    del got, g, memory  # before the stream their free is ordered on


@pytest.mark.gpu
@requires_cuda
def test_cupy_output_buffer_goes_with_its_array(seed):
    """The cupy.ndarray (and any view of it) holds the ragvit.Buffer it was built over; the
    Buffer goes when the last of them goes."""
    cupy = _cupy()
    x = _rng(seed).standard_normal((6, 8)).astype(np.float32)
    y = ragvit.gelu(cupy.asarray(x))
    assert type(y) is cupy.ndarray
    buf = y.data.mem._owner
    assert isinstance(buf, ragvit.Buffer)
    assert buf.shape == y.shape and buf.dtype == y.dtype.name
    assert buf.__cuda_array_interface__["data"][0] == y.data.ptr
    ref = weakref.ref(buf)
    view = y[2:]
    del buf, y
    gc.collect()
    assert ref() is not None, "a view of the array must hold the Buffer"
    garbage = [ragvit.gelu(cupy.asarray(x + 7)) for _ in range(4)]  # would reuse freed memory
    np.testing.assert_allclose(cupy.asnumpy(view), torch.nn.functional.gelu(
        torch.from_numpy(x[2:])).numpy(), rtol=1e-5, atol=1e-5)
    del view, garbage
    gc.collect()
    assert ref() is None, "the Buffer outlived its arrays"
    cupy.cuda.Device().synchronize()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.sanitizer
@pytest.mark.parametrize("launch", ["stream_given", "legacy_default"])
def test_cupy_output_is_ready_on_the_current_stream(launch, seed):
    """The op runs on its launch stream behind a long sleep; its output is read at once on
    another CuPy current stream, which must wait for the launch: a copy that ran early would
    read the memory's earlier contents."""
    cupy = _cupy()
    x = _rng(seed).standard_normal((1024, 256)).astype(np.float32)
    expected = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    cx, stale = cupy.asarray(x), cupy.asarray(x + 100)
    launch_stream = torch.cuda.Stream() if launch == "stream_given" else None
    kw = {"stream": launch_stream.cuda_stream} if launch_stream is not None else {}
    for _ in range(3):
        # dropped at once on the launch stream: other values where y's memory comes from (a
        # kept block on the legacy stream, the pool on another)
        ragvit.gelu(stale, **kw)
    reader = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()
    with torch.cuda.stream(launch_stream):  # None: torch's default stream, the legacy one
        torch.cuda._sleep(50_000_000)
    with reader:
        y = ragvit.gelu(cx, **kw)
        copy = y.copy()  # queued on reader
        assert ragvit._C._cupy_current_stream(cx.device.id) == reader.ptr
    reader.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(copy), expected, rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()
    del y, copy
    cupy.cuda.Device().synchronize()


@pytest.mark.gpu
@requires_cuda
def test_cupy_current_stream_is_read_as_cupy_reports_it():
    cupy = _cupy()
    ragvit.gelu(cupy.ones((2, 3), cupy.float32))  # resolves CuPy's constructors
    device = cupy.cuda.Device().id
    assert ragvit._C._cupy_current_stream(device) == cupy.cuda.get_current_stream().ptr
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        assert ragvit._C._cupy_current_stream(device) == side.ptr
    assert ragvit._C._cupy_current_stream(device) == cupy.cuda.get_current_stream().ptr


@pytest.mark.gpu
@requires_cuda
@pytest.mark.sanitizer
def test_cupy_attention_matches_the_reference_on_two_streams(gen, seed):
    cupy = _cupy()
    lengths = (197, 1, 64)
    total, heads, dim = sum(lengths), 6, 64
    q, k, v = (torch.randn(total, heads, dim, generator=gen).half() for _ in range(3))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    args = [cupy.asarray(t.numpy()) for t in (q, k, v, cu)]
    for stream in (cupy.cuda.Stream.null, cupy.cuda.Stream(non_blocking=True)):
        with stream:
            out = ragvit.attention(*args, max(lengths))
        stream.synchronize()
        assert type(out) is cupy.ndarray
        check_attention(torch.from_numpy(cupy.asnumpy(out)), q, k, v, cu, seed=seed)
        del out  # before the stream its free is ordered on


@pytest.mark.gpu
@requires_cuda
@pytest.mark.sanitizer
@pytest.mark.parametrize("drop_on, reuse_on", [("side", "side"), ("legacy", "legacy"),
                                               ("side", "legacy"), ("legacy", "side")])
def test_deleting_an_output_while_its_kernel_runs_is_safe(drop_on, reuse_on, gen, seed):
    """The free is stream-ordered: memory is reused only after the kernel that writes it has
    run. Outputs of distinct values are dropped while their kernels wait behind a busy stream,
    then one more is made on the same or the other stream (torch's side streams do not
    synchronize with the legacy default one) while those kernels are still queued: had it
    been given a dropped output's memory early, a queued kernel would overwrite it."""
    cupy = _cupy()
    x = torch.randn(4096, 256, generator=gen).cuda()
    scales = [1.0 + i / 8 for i in range(9)]
    inputs = [cupy.asarray(x * c) for c in scales]  # CAI v2 of torch: ready after the sync
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    streams = {"side": side, "legacy": torch.cuda.default_stream()}
    kwargs = {"side": {"stream": side.cuda_stream}, "legacy": {}}
    with torch.cuda.stream(streams[drop_on]):
        torch.cuda._sleep(100_000_000)  # keeps the stream busy while outputs are dropped
        for cx in inputs[:-1]:
            out = ragvit.gelu(cx, **kwargs[drop_on])
            del out
    kept = ragvit.gelu(inputs[-1], **kwargs[reuse_on])
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.as_tensor(kept, device="cuda"),
                               torch.nn.functional.gelu(x * scales[-1]), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("current", ["default", "non_default"])
def test_cupy_ten_thousand_calls_keep_device_memory_flat(current, seed):
    """Device memory, the inputs' reference counts and the marks' events stay flat; on a
    non-default current stream each call also orders that stream after the launch."""
    cupy = _cupy()
    _, inputs = _problems(_rng(seed))["attention"]
    args = [cupy.asarray(inputs[n]) for n in ("q", "k", "v", "cu_seqlens")]
    stream = cupy.cuda.Stream.null if current == "default" else cupy.cuda.Stream(
        non_blocking=True)
    with stream:
        for _ in range(100):
            ragvit.attention(*args, 6)
        cupy.cuda.Device().synchronize()
        free_before = cupy.cuda.runtime.memGetInfo()[0]
        counts = [sys.getrefcount(a) for a in args]
        events = _marks(args[0].device.id)[0]
        for _ in range(10_000):
            ragvit.attention(*args, 6)
        cupy.cuda.Device().synchronize()
    free_after = cupy.cuda.runtime.memGetInfo()[0]
    assert free_before - free_after <= 2 * 2**20, (
        f"device memory fell by {free_before - free_after} bytes over 10k calls")
    assert [sys.getrefcount(a) for a in args] == counts
    assert _marks(args[0].device.id)[0] == events, "the marks' events were not reused"


def _marks(device: int = 0) -> tuple[int, int]:
    """(events the marks' pool created, marks recorded) on device, for the process so far."""
    stats = ragvit._C._memory_stats(device)
    return stats["events"], stats["marks"]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("launch", ["legacy_default", "side_stream"])
def test_outputs_dropped_on_the_legacy_stream_are_kept_for_the_next_call(launch, seed):
    """An output whose last use was on the legacy default stream keeps its memory for the
    next allocation of its size there (no CUDA call); after a call on another stream it goes
    back to the pool. Either way the next output's values are right."""
    x = torch.randn(64, 32, device="cuda")
    expected = torch.nn.functional.gelu(x)
    fake = DLPackOnly(x)
    side = torch.cuda.Stream()
    kw = {"stream": side.cuda_stream} if launch == "side_stream" else {}
    torch.cuda.synchronize()
    first = ragvit.gelu(fake, **kw)
    ptr = first.__cuda_array_interface__["data"][0]
    del first
    reused = ragvit._C._memory_stats(0)["reused"]
    second = ragvit.gelu(fake, **kw)
    count = ragvit._C._memory_stats(0)["reused"] - reused
    if launch == "legacy_default":
        assert count == 1 and second.__cuda_array_interface__["data"][0] == ptr
    else:
        assert count == 0
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.from_dlpack(second), expected, rtol=1e-5, atol=1e-5)
    big = DLPackOnly(torch.randn(2048, 1024, device="cuda"))  # 8 MiB: back to the pool
    del second
    for _ in range(2):
        ragvit.gelu(big)
    assert ragvit._C._memory_stats(0)["reused"] - reused == count
    torch.cuda.synchronize()


def test_memory_stats_counts_marks_in_a_cuda_build():
    if ragvit._C.cuda_is_compiled():
        stats = ragvit._C._memory_stats(0)
        assert set(stats) == {"events", "marks", "reused"} and min(stats.values()) >= 0
    else:
        with pytest.raises(RuntimeError, match="needs a CUDA build of ragvit"):
            ragvit._C._memory_stats(0)
    with pytest.raises(TypeError, match="at most 1 argument"):
        ragvit._C._memory_stats(0, 1)


@pytest.mark.gpu
@requires_cuda
def test_marks_reuse_their_events(seed):
    """Each call that allocates records one mark; a dropped output's event goes back to the
    pool, so 10k calls create no events, with and without a hand-off to CuPy."""
    x = torch.randn(5, 8, device="cuda")
    fake = DLPackOnly(x)
    calls = [lambda: ragvit.gelu(fake)]
    try:
        cupy = _cupy()
        cx = cupy.asarray(x)
        calls.append(lambda: ragvit.gelu(cx))
    except pytest.skip.Exception:
        pass
    for call in calls:
        for _ in range(100):
            call()
        torch.cuda.synchronize()
        events, marks = _marks()
        for _ in range(10_000):
            call()
        torch.cuda.synchronize()
        events_after, marks_after = _marks()
        assert events_after == events, f"{events_after - events} events created over 10k calls"
        assert marks_after - marks == 10_000, "one mark per call"
    kept = [ragvit.gelu(fake) for _ in range(50)]  # live outputs hold their events
    assert _marks()[0] <= events + 50
    del kept


@pytest.mark.gpu
@requires_cuda
@pytest.mark.sanitizer
@pytest.mark.parametrize("op", ["pack", "repack", "gelu"])
def test_a_call_records_one_mark_for_all_its_buffers(op, seed):
    """The outputs a call allocates and the Buffers it reads share one mark: pack (three
    outputs) and repack (three outputs, packed read from a Buffer) record one event each call,
    not one per buffer, and their results are right."""
    call, host = _problems(_rng(seed))[op]
    # float inputs shifted by 1000 come back unchanged from gelu: a Buffer holding them
    shifted = {n: a + np.float32(1000) if a.dtype == np.float32 else a for n, a in host.items()}
    expected = _as_tuple(call(shifted))
    inputs = {n: DLPackOnly(torch.from_numpy(a).cuda()) for n, a in shifted.items()}
    if op != "pack":
        inputs = {n: ragvit.gelu(a) if shifted[n].dtype == np.float32 else a
                  for n, a in inputs.items()}
        assert any(isinstance(a, ragvit.Buffer) for a in inputs.values())
        expected = _as_tuple(call({n: np.asarray(torch.nn.functional.gelu(torch.from_numpy(a)))
                                   if a.dtype == np.float32 else a
                                   for n, a in shifted.items()}))
    torch.cuda.synchronize()
    events, marks = _marks()
    got = _as_tuple(call(inputs))
    assert _marks()[1] - marks == 1, "one mark per call, shared by every Buffer it touched"
    assert _marks()[0] - events <= 1
    torch.cuda.synchronize()
    for g, e in zip(got, expected, strict=True):
        assert isinstance(g, ragvit.Buffer)
        _check_same(torch.from_dlpack(g).cpu().numpy(), e, exact=op != "gelu",
                    note=f"{op}, seed={seed}")
    del got, g, inputs
    torch.cuda.synchronize()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.sanitizer
def test_cuda_buffer_protocols(seed):
    x = torch.randn(5, 8, device="cuda")
    buf = ragvit.gelu(DLPackOnly(x))
    assert isinstance(buf, ragvit.Buffer)
    device = x.device.index or 0
    assert buf.__dlpack_device__() == (kDLCUDA, device)
    assert not hasattr(buf, "__array_interface__")
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["typestr"] == "<f4" and cai["shape"] == (5, 8)
    own = cai["stream"]  # ragvit's own stream, waiting on the launch: it outlives any caller's
    assert isinstance(own, int) and own not in (0, 1, 2)
    t = torch.from_dlpack(buf)  # torch's current stream: the legacy one here
    assert t.data_ptr() == cai["data"][0], "torch.from_dlpack copied"
    torch.testing.assert_close(t, torch.nn.functional.gelu(x), rtol=1e-5, atol=1e-5)
    for stream in (None, -1, 1, 2):
        buf.__dlpack__(stream=stream)
    side = torch.cuda.Stream()
    buf.__dlpack__(stream=side.cuda_stream)
    assert buf.__cuda_array_interface__["stream"] == own, "one stream of ragvit's per device"
    for bad in (0, -2):
        with pytest.raises(ValueError, match=r"stream must be None, -1, 1 \(legacy default\)"):
            buf.__dlpack__(stream=bad)
    with pytest.raises(BufferError, match="dl_device must be the buffer's own device"):
        buf.__dlpack__(dl_device=(kDLCPU, 0))
    torch.cuda.synchronize()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.sanitizer
def test_buffers_outlive_the_streams_they_were_made_and_read_on(seed):
    """A caller's stream destroyed before the output goes: the output is still read right
    (through DLPack and the CUDA Array Interface) and freed without touching that stream."""
    cupy = _cupy()
    gen = np.random.default_rng(seed % 2**32)
    x = gen.standard_normal((64, 32)).astype(np.float32)
    expected = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    made = cupy.cuda.Stream(non_blocking=True)
    with made:
        buf = ragvit.gelu(DLPackOnly(cupy.asarray(x)), stream=made.ptr)
    made.synchronize()
    del made  # cudaStreamDestroy
    reader = cupy.cuda.Stream(non_blocking=True)
    with reader:
        got = cupy.from_dlpack(buf)
        again = ragvit.gelu(got)  # reads a Buffer-backed array on another stream
    reader.synchronize()
    del reader
    np.testing.assert_allclose(cupy.asnumpy(got), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cupy.asnumpy(again), torch.nn.functional.gelu(
        torch.from_numpy(expected)).numpy(), rtol=1e-5, atol=1e-5)
    assert buf.__cuda_array_interface__["stream"] not in (0, 1, 2)
    del got, again, buf
    cupy.cuda.Device().synchronize()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_numba_cuda_arrays_get_buffers(op, seed):
    numba_cuda = pytest.importorskip("numba.cuda")
    if not numba_cuda.is_available():
        pytest.skip("numba sees no CUDA device")
    problems = _cuda_problem_inputs(seed, numba_cuda.to_device)
    call, inputs, expected = problems[op]
    got = _as_tuple(call(inputs))
    torch.cuda.synchronize()
    for g, e in zip(got, expected, strict=True):
        assert isinstance(g, ragvit.Buffer), f"{op}: got {type(g).__name__}"
        back = numba_cuda.as_cuda_array(g)  # through the buffer's CUDA Array Interface
        _check_same(back.copy_to_host(), e, exact=op in ("pack", "repack", "unpack",
                                                          "gather_prefix", "topk_index"),
                    note=f"{op}, seed={seed}")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_jax_inputs_get_jax_outputs(op, seed):
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError as error:
        pytest.skip(f"jax has no GPU backend: {error}")
    was_x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)  # topk_index returns int64
    try:
        problems = _cuda_problem_inputs(seed, lambda a: jax.device_put(a, gpu))
        call, inputs, expected = problems[op]
        got = _as_tuple(call(inputs))
        for g, e in zip(got, expected, strict=True):
            assert isinstance(g, jax.Array), f"{op}: got {type(g).__name__}"
            assert g.devices() == {gpu}
            _check_same(np.asarray(g), e, exact=op in ("pack", "repack", "unpack",
                                                        "gather_prefix", "topk_index"),
                        note=f"{op}, seed={seed}")
    finally:
        jax.config.update("jax_enable_x64", was_x64)
