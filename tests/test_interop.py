"""Tensor exchange: every import path, stride units, lifetimes, leaks, refusals.

Paths: torch tensors (the DLPack C exchange API), NumPy, producers offering only versioned or
only legacy DLPack, capsules built by hand with ctypes (byte_offset included), and on CUDA
the CUDA Array Interface v2 and v3. Inputs are views of a (T, 3, H, D) buffer and outputs
views of a wider one, so a stride read in the wrong unit (DLPack counts elements, CAI
bytes) or a write outside the view shows. The fakes count their calls, so no test can pass
by silently taking another path.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import sys
import tracemalloc
import weakref

import numpy as np
import pytest
import torch
from support.checks import check_attention, check_cls_attn
from support.devices import gpu_marks, requires_cuda
from support.inputs import (
    INT32_POISON,
    covered_rows,
    make_cu_seqlens,
    make_qkv,
    poison,
    same_bits,
    seed_note,
)
from support.tolerances import DTYPE_IDS, TOL

import ragvit
from ragvit.reference import attention_reference, pack_reference

kDLCPU, kDLCUDA, kDLOpenCL = 1, 2, 4
FLAG_READ_ONLY = 1

# ---- fake producers ----


def _export(array, stream, max_version):
    """array.__dlpack__ with only the keywords that were given (NumPy wants no
    stream at all on the CPU; torch takes both)."""
    kwargs = {}
    if stream is not None:
        kwargs["stream"] = stream
    if max_version is not None:
        kwargs["max_version"] = max_version
    return array.__dlpack__(**kwargs)


class VersionedOnly:
    """Offers DLPack >= 1.0 only: refuses a __dlpack__ call without max_version."""

    def __init__(self, array):
        self.array = array
        self.calls = 0

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if max_version is None or tuple(max_version)[0] < 1:
            raise BufferError("VersionedOnly exports DLPack >= 1.0 capsules only")
        self.calls += 1
        return _export(self.array, stream, tuple(max_version))


class LegacyOnly:
    """A pre-1.0 producer: __dlpack__(stream=None) knows no max_version keyword and
    returns a legacy "dltensor" capsule."""

    def __init__(self, array):
        self.array = array
        self.calls = 0

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, stream=None):
        self.calls += 1
        return _export(self.array, stream, None)


class LegacyIgnoringMaxVersion(LegacyOnly):
    """Accepts max_version but still returns a legacy capsule (allowed by the spec)."""

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls += 1
        return _export(self.array, stream, None)


class CAIOnly:
    """Offers only __cuda_array_interface__, copied from a torch CUDA tensor's."""

    def __init__(self, tensor, *, version=2, stream=None, typestr=None, read_only=False):
        self.tensor = tensor
        self.version = version
        self.stream = stream
        self.typestr = typestr
        self.read_only = read_only
        self.calls = 0

    @property
    def __cuda_array_interface__(self):
        self.calls += 1
        source = self.tensor
        if source.dtype == torch.bfloat16:  # what torch reports for bf16 is not portable
            source = source.view(torch.float16)
        cai = dict(source.__cuda_array_interface__)
        cai.pop("stream", None)
        cai["version"] = self.version
        if self.version >= 3:
            cai["stream"] = self.stream
        if self.typestr is not None or self.tensor.dtype == torch.bfloat16:
            cai["typestr"] = self.typestr or "<V2"
        if self.read_only:
            cai["data"] = (cai["data"][0], True)
        return cai


# ---- DLPack capsules built by hand (ctypes) ----


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _DELETER),
    ]


# Private function pointers, so the shared ctypes.pythonapi entries stay untouched.
_capsule_new = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))
_capsule_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi)
)

# Capsule names must outlive their capsules: module-level constants do.
_NAME_VERSIONED = b"dltensor_versioned"
_NAME_LEGACY = b"dltensor"
_NAME_USED_LEGACY = b"used_dltensor"
_NAME_USED_VERSIONED = b"used_dltensor_versioned"
_NAME_OTHER = b"not_a_tensor"

_DL_DTYPES = {
    torch.float32: (2, 32),
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.float64: (2, 64),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
    torch.uint8: (1, 8),
    torch.bool: (6, 8),
}


class CtypesProducer:
    """Builds a fresh DLPack capsule by hand on every __dlpack__ call.

    The managed tensor lives in `live` until its deleter runs; the deleter
    removes it (a second call for the same tensor raises inside the callback
    and is counted in `bad_deletes`). `base`: a tensor whose data_ptr becomes
    DLTensor.data, the view's offset inside it going to byte_offset. null_data /
    null_shape: a spec-breaking producer's NULL DLTensor.data / DLTensor.shape; shape: the
    extents it claims instead of the tensor's (same number of dimensions).
    """

    def __init__(
        self, tensor, *, versioned=True, lanes=1, device_type=None, major=1, flags=0, base=None,
        null_data=False, null_shape=False, shape=None,
    ):
        self.tensor = tensor
        self.shape = shape
        self.base = base
        self.null_data = null_data
        self.null_shape = null_shape
        self.versioned = versioned
        self.lanes = lanes
        self.device_type = device_type or (kDLCUDA if tensor.is_cuda else kDLCPU)
        self.device_id = (tensor.device.index or 0) if tensor.is_cuda else 0
        self.major = major
        self.flags = flags
        self.live = {}
        self.calls = 0
        self.deleted = 0
        self.bad_deletes = 0
        self.last_capsule = None
        self._deleter = _DELETER(self._on_delete)

    def _on_delete(self, address):
        if self.live.pop(address, None) is None:
            self.bad_deletes += 1
        else:
            self.deleted += 1

    def __dlpack_device__(self):
        return (self.device_type, self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if self.versioned and (max_version is None or tuple(max_version)[0] < 1):
            raise BufferError("this producer exports DLPack >= 1.0 capsules only")
        t = self.tensor
        shape = (ctypes.c_int64 * t.dim())(*(t.shape if self.shape is None else self.shape))
        strides = (ctypes.c_int64 * t.dim())(*t.stride())
        code, bits = _DL_DTYPES[t.dtype]
        data = t.data_ptr() if self.base is None else self.base.data_ptr()
        dl = _DLTensor(
            data=None if self.null_data else data,
            device=_DLDevice(self.device_type, self.device_id),
            ndim=t.dim(),
            dtype=_DLDataType(code, bits, self.lanes),
            shape=None if self.null_shape else ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
            strides=ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)),
            byte_offset=0 if self.null_data else t.data_ptr() - data,
        )
        if self.versioned:
            managed = _DLManagedTensorVersioned(
                version=_DLPackVersion(self.major, 0),
                manager_ctx=None,
                deleter=self._deleter,
                flags=self.flags,
                dl_tensor=dl,
            )
            name = _NAME_VERSIONED
        else:
            managed = _DLManagedTensor(dl_tensor=dl, manager_ctx=None, deleter=self._deleter)
            name = _NAME_LEGACY
        address = ctypes.addressof(managed)
        self.live[address] = (managed, shape, strides)
        self.calls += 1
        # No capsule destructor: an unconsumed capsule leaks its struct into
        # `live`, which the producer owns anyway.
        self.last_capsule = _capsule_new(address, name, None)
        return self.last_capsule


def capsule_name(capsule) -> bytes:
    return _capsule_get_name(capsule)


class ReturnsThis:
    """A producer whose __dlpack__ returns a fixed object (e.g. a used capsule)."""

    def __init__(self, value, device=(kDLCPU, 0)):
        self.value = value
        self.device = device
        self.calls = 0

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls += 1
        return self.value


# ---- paths ----

CPU_PATHS = (
    "torch",
    "numpy",
    "versioned",
    "legacy",
    "legacy_ignores_max_version",
    "ctypes_versioned",
    "ctypes_legacy",
)
CUDA_PATHS = (
    "torch_cuda",
    "versioned_cuda",
    "legacy_cuda",
    "ctypes_versioned_cuda",
    "cai_v2",
    "cai_v3",
)
FAKE_PATHS = (
    "versioned",
    "legacy",
    "legacy_ignores_max_version",
    "ctypes_versioned",
    "ctypes_legacy",
)


def _path_device(path):
    return "cuda" if path in CUDA_PATHS else "cpu"


def _path_supports(path, dtype):
    return not (dtype == torch.bfloat16 and (path == "numpy" or path.startswith("cai")))


def wrap(path, t):
    """t (a torch tensor on the path's device) as the path's producer object."""
    kind = path[: -len("_cuda")] if path.endswith("_cuda") else path
    if kind == "torch":
        return t
    if kind == "numpy":
        return t.numpy()
    backing = t.numpy() if t.device.type == "cpu" and t.dtype != torch.bfloat16 else t
    if kind == "versioned":
        return VersionedOnly(backing)
    if kind == "legacy":
        return LegacyOnly(backing)
    if kind == "legacy_ignores_max_version":
        return LegacyIgnoringMaxVersion(backing)
    if kind == "ctypes_versioned":
        return CtypesProducer(t, versioned=True)
    if kind == "ctypes_legacy":
        return CtypesProducer(t, versioned=False)
    if kind == "cai_v2":
        return CAIOnly(t, version=2)
    if kind == "cai_v3":
        # CAI v3 forbids stream 0; torch reports the legacy default stream as 0.
        return CAIOnly(t, version=3, stream=torch.cuda.current_stream().cuda_stream or 1)
    raise ValueError(path)


def _assert_fakes_used(objects):
    """Every fake producer among objects was asked for its data (and ctypes
    capsules were consumed and deleted exactly once)."""
    for obj in objects:
        if hasattr(obj, "calls"):
            assert obj.calls >= 1, f"{type(obj).__name__} was never asked for its data"
        if isinstance(obj, CtypesProducer):
            assert obj.bad_deletes == 0, "a DLPack deleter ran twice"
            assert obj.deleted == obj.calls and not obj.live, "a consumed capsule was not deleted"
            used = _NAME_USED_VERSIONED if obj.versioned else _NAME_USED_LEGACY
            assert capsule_name(obj.last_capsule) == used, "capsule not renamed after use"


def _path_params(dtypes=(torch.float32, torch.float16, torch.bfloat16)):
    params = []
    for path in CPU_PATHS + CUDA_PATHS:
        marks = gpu_marks() if path in CUDA_PATHS else []
        for dtype in dtypes:
            if _path_supports(path, dtype):
                params.append(
                    pytest.param(path, dtype, marks=marks, id=f"{path}-{DTYPE_IDS[dtype]}")
                )
    return params


def _qkv_problem(gen, dtype, device, lengths=(5, 0, 70, 1), tail=3, num_heads=2, head_dim=64):
    """q, k, v views of one (T, 3, H, D) buffer, cu_seqlens, and poisoned outputs:
    out = view [:, 0] of a (T, 2, H, D) buffer and cls_attn = every other entry
    of a (2T,) buffer, so writes outside the views show."""
    total = sum(lengths) + tail
    q, k, v = make_qkv(gen, total, num_heads, head_dim, dtype, device, layout="qkv_view")
    cu_seqlens = make_cu_seqlens(lengths, device)
    out_buffer = poison((total, 2, num_heads, head_dim), dtype, device)
    cls_buffer = poison((2 * total,), torch.float32, device)
    return q, k, v, cu_seqlens, out_buffer, cls_buffer


# ---- every path computes the right thing ----


@pytest.mark.parametrize("path, dtype", _path_params())
def test_attention_through_every_path(path, dtype, gen, seed):
    device = _path_device(path)
    q, k, v, cu_seqlens, out_buffer, cls_buffer = _qkv_problem(gen, dtype, device)
    out, cls_attn = out_buffer[:, 0], cls_buffer[::2]
    assert q.stride(0) == 3 * q.shape[1] * q.shape[2] and not out.is_contiguous()
    args = [wrap(path, t) for t in (q, k, v, cu_seqlens, out, cls_attn)]
    result = ragvit.attention(*args[:4], out=args[4], cls_attn=args[5])
    assert result is args[4]
    if device == "cuda":
        torch.cuda.synchronize()
    _assert_fakes_used(args)
    check_attention(out, q, k, v, cu_seqlens, seed=seed)
    check_cls_attn(cls_attn, q, k, cu_seqlens, seed=seed)
    assert torch.isnan(out_buffer[:, 1]).all() and torch.isnan(cls_buffer[1::2]).all(), (
        "a write landed outside the strided output views"
    )


ALL_PATHS = [pytest.param(p, id=p) for p in CPU_PATHS] + [
    pytest.param(p, id=p, marks=gpu_marks()) for p in CUDA_PATHS
]


@pytest.mark.parametrize("path", ALL_PATHS)
def test_pack_into_and_unpack_through_every_path(path, gen, seed):
    device = _path_device(path)
    note = seed_note(seed)
    B, N, C = 3, 20, 30
    big = torch.randint(-100, 101, (B, N, C + 4), generator=gen).to(torch.float16).to(device)
    x = big[:, :, :C]  # row stride C + 4
    mask = torch.rand((B, N), generator=gen) < 0.5
    keep = mask.to(device)
    exp_packed, exp_cu, exp_indices = pack_reference(x, keep)
    total = int(exp_cu[-1])
    capacity = B * N
    out = poison((capacity, C), torch.float16, device)
    cu_seqlens = poison((B + 1,), torch.int32, device)
    indices = poison((capacity,), torch.int32, device)
    args = [wrap(path, t) for t in (x, keep, out, cu_seqlens, indices)]
    assert ragvit.pack_into(*args[:4], indices=args[4]) is None
    if device == "cuda":
        torch.cuda.synchronize()
    _assert_fakes_used(args)
    assert torch.equal(cu_seqlens.cpu(), exp_cu.cpu()), "cu_seqlens differ" + note
    assert torch.equal(out[:total].cpu(), exp_packed.cpu()), "packed rows differ" + note
    assert torch.isnan(out[total:]).all()
    assert torch.equal(indices[:total].cpu(), exp_indices.cpu()), "indices differ" + note
    assert (indices[total:] == INT32_POISON).all()

    padded = poison((B, N, C), torch.float16, device)
    uargs = [wrap(path, t) for t in (out, cu_seqlens, indices, padded)]
    result = ragvit.unpack(uargs[0], uargs[1], N, indices=uargs[2], fill=-1.0, out=uargs[3])
    assert result is uargs[3]
    if device == "cuda":
        torch.cuda.synchronize()
    _assert_fakes_used(uargs)
    expected = torch.where(keep[..., None], x, torch.full_like(x, -1.0))
    assert torch.equal(padded.cpu(), expected.cpu()), "unpack differs" + note


def test_mixed_producers_in_one_call(gen, seed):
    q, k, v, cu_seqlens, out_buffer, cls_buffer = _qkv_problem(gen, torch.float32, "cpu")
    out = out_buffer[:, 0]
    args = [
        q,
        k.numpy(),
        VersionedOnly(v.numpy()),
        LegacyOnly(cu_seqlens.numpy()),
        CtypesProducer(out),
    ]
    assert ragvit.attention(*args[:4], out=args[4]) is args[4]
    _assert_fakes_used(args)
    check_attention(out, q, k, v, cu_seqlens, seed=seed)


def test_torch_tensors_take_the_exchange_api(gen, seed):
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this torch has no DLPack C exchange API")

    class NoDlpack(torch.Tensor):
        def __dlpack__(self, *args, **kwargs):
            raise AssertionError("ragvit called __dlpack__ on a torch tensor")

    q, k, v, cu_seqlens, out_buffer, _ = _qkv_problem(gen, torch.bfloat16, "cpu")
    out = out_buffer[:, 0]
    qs, ks, vs, cus, outs = (t.as_subclass(NoDlpack) for t in (q, k, v, cu_seqlens, out))
    assert ragvit.attention(qs, ks, vs, cus, out=outs) is outs
    check_attention(out, q, k, v, cu_seqlens, seed=seed)


def test_dlpack_byte_offset_is_honoured(gen, seed):
    q, k, v, cu_seqlens, out_buffer, _ = _qkv_problem(gen, torch.float32, "cpu")
    base = q.untyped_storage()  # DLTensor.data = start of the (T, 3, H, D) buffer
    producers = [CtypesProducer(t, base=base) for t in (q, k, v)]
    assert k.data_ptr() > base.data_ptr()  # k's and v's byte_offset are nonzero
    out = out_buffer[:, 1]
    out_producer = CtypesProducer(out, versioned=False, base=out_buffer.untyped_storage())
    ragvit.attention(*producers, cu_seqlens, out=out_producer)
    _assert_fakes_used(producers + [out_producer])
    check_attention(out, q, k, v, cu_seqlens, seed=seed)
    assert torch.isnan(out_buffer[:, 0]).all(), "byte_offset ignored: wrote at the buffer start"


# ---- outputs allocated by ragvit, lifetimes ----


@pytest.mark.parametrize("path", ["torch", "numpy"])
def test_allocated_output_outlives_the_inputs(path, gen, seed):
    q, k, v, cu_seqlens, _, _ = _qkv_problem(gen, torch.float16, "cpu", tail=0)
    keep = [t.clone() for t in (q, k, v, cu_seqlens)]
    args = [wrap(path, t) for t in (q, k, v, cu_seqlens)]
    refs = [weakref.ref(a) for a in args]
    result = ragvit.attention(*args)
    del args, q, k, v, cu_seqlens
    gc.collect()
    assert all(r() is None for r in refs), "ragvit kept an input alive after the call"
    if path == "numpy":
        assert isinstance(result, np.ndarray)
    else:
        assert isinstance(result, torch.Tensor)
    out = torch.as_tensor(result)
    garbage = [torch.full((4096,), math.nan) for _ in range(16)]  # reuse freed memory
    covered = covered_rows(keep[3], keep[0].shape[0])
    expected = attention_reference(*keep)[covered]
    torch.testing.assert_close(
        out.to(torch.float64)[covered],
        expected,
        **TOL[torch.float16],
        msg=lambda m: m + seed_note(seed),
    )
    del garbage


@pytest.mark.parametrize("path", [p for p in FAKE_PATHS + ("numpy",)])
def test_producer_deleted_right_after_the_call(path, gen, seed):
    q, k, v, cu_seqlens, out_buffer, _ = _qkv_problem(gen, torch.float32, "cpu")
    out = out_buffer[:, 0]
    copies = [t.clone() for t in (q, k, v)]
    args = [wrap(path, t) for t in (q, k, v, cu_seqlens)]
    producer_refs = [weakref.ref(a) for a in args]
    backing_refs = [weakref.ref(a.array) for a in args if hasattr(a, "array")]
    ragvit.attention(*args, out=out)
    _assert_fakes_used(args)
    del args
    gc.collect()
    assert all(r() is None for r in producer_refs), "a producer outlived the call"
    assert all(r() is None for r in backing_refs), "an exported array was never released"
    check_attention(out, *copies, cu_seqlens, seed=seed)


# ---- no leaks over 10,000 calls ----


def _rss_bytes():
    """This process's resident size, or None where it says nothing about leaks: under
    AddressSanitizer (scripts/sanitize_cpu.sh) freed blocks stay resident in its quarantine."""
    if os.environ.get("RAGVIT_SANITIZE"):
        return None
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


LEAK_PATHS = [pytest.param(p, id=p) for p in CPU_PATHS] + [
    pytest.param(p, id=p, marks=gpu_marks()) for p in ("torch_cuda", "cai_v2", "cai_v3")
]


@pytest.mark.parametrize("path", LEAK_PATHS)
def test_no_refcount_or_memory_growth_over_10k_calls(path):
    device = _path_device(path)
    gen = torch.Generator().manual_seed(11)
    q, k, v = make_qkv(gen, 8, 1, 32, torch.float32, device)
    cu_seqlens = make_cu_seqlens([3, 5], device)
    out = poison(q.shape, torch.float32, device)
    if path.startswith("ctypes"):
        # Building capsules by hand is slow in Python: q and out take that path.
        args = [wrap(path, q), k, v, cu_seqlens, wrap(path, out)]
    else:
        args = [wrap(path, t) for t in (q, k, v, cu_seqlens, out)]
    watched = list(args) + [a.array for a in args if hasattr(a, "array")]

    def call():
        ragvit.attention(args[0], args[1], args[2], args[3], out=args[4])

    for _ in range(200):
        call()
    gc.collect()
    counts = [sys.getrefcount(o) for o in watched]
    rss_before = _rss_bytes()
    tracemalloc.start()
    try:
        traced_before = tracemalloc.get_traced_memory()[0]
        for _ in range(10_000):
            call()
        gc.collect()
        traced_growth = tracemalloc.get_traced_memory()[0] - traced_before
    finally:
        tracemalloc.stop()
    if device == "cuda":
        torch.cuda.synchronize()
    rss_after = _rss_bytes()
    assert [sys.getrefcount(o) for o in watched] == counts, "reference counts changed"
    assert traced_growth < 64 * 1024, f"Python heap grew by {traced_growth} bytes"
    if rss_before is not None:
        growth = rss_after - rss_before
        assert growth < 4 * 1024 * 1024, f"RSS grew by {growth} bytes over 10k calls"
    for a in args:
        if hasattr(a, "calls"):
            assert a.calls >= 10_200, "the producer was not asked on every call"
    _assert_fakes_used(args)
    torch.testing.assert_close(
        out[:8].double().cpu(), attention_reference(q, k, v, cu_seqlens)[:8], **TOL[torch.float32]
    )


# ---- refusals ----


def _refusal_problem(device="cpu"):
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(gen, 12, 2, 32, torch.float32, device)
    return q, k, v, make_cu_seqlens([5, 7], device), poison(q.shape, torch.float32, device)


def _pointer_capsule(name):
    keepalive = ctypes.create_string_buffer(256)
    return _capsule_new(ctypes.addressof(keepalive), name, None), keepalive


@pytest.mark.parametrize(
    "name",
    [_NAME_USED_LEGACY, _NAME_USED_VERSIONED, _NAME_OTHER],
    ids=["used_dltensor", "used_dltensor_versioned", "other_name"],
)
def test_consumed_or_foreign_capsule_is_refused(name):
    q, k, v, cu_seqlens, out = _refusal_problem()
    capsule, keepalive = _pointer_capsule(name)
    producer = ReturnsThis(capsule)
    with pytest.raises(BufferError, match=r"capsule|used_dltensor|unconsumed"):
        ragvit.attention(producer, k, v, cu_seqlens, out=out)
    assert producer.calls >= 1
    assert torch.isnan(out).all()
    assert capsule_name(capsule) == name, "a refused capsule must not be renamed"
    del keepalive


@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "legacy"])
def test_capsule_consumed_by_someone_else_is_refused(versioned):
    q, k, v, cu_seqlens, out = _refusal_problem()
    array = q.numpy()
    capsule = array.__dlpack__(max_version=(1, 0)) if versioned else array.__dlpack__()
    torch.from_dlpack(capsule)  # the first consumer renames it "used_*"
    assert capsule_name(capsule).startswith(b"used_")
    with pytest.raises(BufferError, match=r"capsule|used_dltensor|unconsumed"):
        ragvit.attention(ReturnsThis(capsule), k, v, cu_seqlens, out=out)
    assert torch.isnan(out).all()


def test_dlpack_returning_a_non_capsule_is_refused():
    q, k, v, cu_seqlens, out = _refusal_problem()
    with pytest.raises(BufferError, match=r"capsule"):
        ragvit.attention(ReturnsThis(42), k, v, cu_seqlens, out=out)
    assert torch.isnan(out).all()


REFUSED_CAPSULES = [
    pytest.param({"lanes": 2}, r"lane", id="lanes2"),
    pytest.param({"lanes": 4, "versioned": False}, r"lane", id="lanes4-legacy"),
    pytest.param({"device_type": kDLOpenCL}, r"device", id="opencl_device"),
    pytest.param({"device_type": 7, "versioned": False}, r"device", id="vulkan_device-legacy"),
    pytest.param({"major": 2}, r"version|1\.x|DLPack", id="dlpack_major2"),
]


@pytest.mark.parametrize("options, pattern", REFUSED_CAPSULES)
def test_unimportable_dlpack_tensor_is_refused(options, pattern):
    q, k, v, cu_seqlens, out = _refusal_problem()
    producer = CtypesProducer(q, **options)
    with pytest.raises(BufferError, match=pattern):
        ragvit.attention(producer, k, v, cu_seqlens, out=out)
    assert producer.calls >= 1
    assert producer.deleted <= 1 and producer.bad_deletes == 0
    assert torch.isnan(out).all()


def test_read_only_dlpack_output_is_refused():
    q, k, v, cu_seqlens, out = _refusal_problem()
    with pytest.raises(ValueError, match=r"read-only|read only"):
        ragvit.attention(q, k, v, cu_seqlens, out=CtypesProducer(out, flags=FLAG_READ_ONLY))
    assert torch.isnan(out).all()
    frozen = out.numpy().copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"read-only|read only"):
        ragvit.attention(q, k, v, cu_seqlens, out=VersionedOnly(frozen))
    assert np.isnan(frozen).all()


@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "legacy"])
def test_deleter_runs_once_when_a_later_argument_is_rejected(versioned):
    """q's capsule is consumed, then out is refused: q's deleter (arbitrary
    Python here) must still run exactly once, and the refusal's own exception
    must reach the caller intact (no pending error while deleters run)."""
    q, k, v, cu_seqlens, out = _refusal_problem()
    producer = CtypesProducer(q, versioned=versioned)
    with pytest.raises(TypeError, match=r"\bout\b"):
        ragvit.attention(producer, k, v, cu_seqlens, out=out.half())
    assert producer.calls == 1 and producer.deleted == 1 and producer.bad_deletes == 0
    assert not producer.live


def test_objects_without_an_array_protocol_are_type_errors():
    q, k, v, cu_seqlens, out = _refusal_problem()
    for bad in (object(), "q", 3.0, [[1.0]], None.__class__):
        with pytest.raises(TypeError, match=r"\bq\b"):
            ragvit.attention(bad, k, v, cu_seqlens, out=out)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("path", FAKE_PATHS)
def test_host_fakes_without_out(path, gen, seed):
    """A producer without an allocator or an array namespace on the host: ragvit
    allocates a ragvit.Buffer and returns it (tests/test_array_types.py covers it)."""
    q, k, v, cu_seqlens, _, _ = _qkv_problem(gen, torch.float32, "cpu", tail=0)
    args = [wrap(path, t) for t in (q, k, v, cu_seqlens)]
    result = ragvit.attention(*args)
    assert isinstance(result, ragvit.Buffer) and result.dtype == "float32"
    covered = covered_rows(cu_seqlens, q.shape[0])
    torch.testing.assert_close(
        torch.from_dlpack(result).double()[covered],
        attention_reference(q, k, v, cu_seqlens)[covered],
        **TOL[torch.float32],
    )


# ---- CUDA only: CAI, streams, fakes without an allocator ----


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "path", ["versioned_cuda", "legacy_cuda", "ctypes_versioned_cuda", "cai_v2", "cai_v3"]
)
def test_cuda_fakes_without_out_get_a_buffer(path, gen, seed):
    """No allocator, no array namespace: the output is a CUDA ragvit.Buffer."""
    q, k, v, cu_seqlens, _, _ = _qkv_problem(gen, torch.float16, "cuda", tail=0)
    args = [wrap(path, t) for t in (q, k, v, cu_seqlens)]
    result = ragvit.attention(*args)
    assert isinstance(result, ragvit.Buffer)
    assert result.__dlpack_device__() == (kDLCUDA, q.device.index or 0)
    check_attention(torch.from_dlpack(result), q, k, v, cu_seqlens, seed=seed)
    packed = torch.arange(30, dtype=torch.float32, device="cuda").reshape(5, 6)
    out = ragvit.unpack(wrap(path, packed), wrap(path, make_cu_seqlens([2, 3], "cuda")), 4)
    assert isinstance(out, ragvit.Buffer) and out.shape == (2, 4, 6)
    expected = ragvit.unpack(packed, make_cu_seqlens([2, 3], "cuda"), 4)
    assert torch.equal(torch.from_dlpack(out), expected)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("version", [2, 3])
def test_cai_bfloat16_is_refused(version, gen):
    q, k, v, cu_seqlens, out_buffer, _ = _qkv_problem(gen, torch.bfloat16, "cuda")
    out = out_buffer[:, 0]
    args = [CAIOnly(t, version=version) for t in (q, k, v)]
    with pytest.raises((TypeError, BufferError), match=r"bfloat16|typestr|<V2"):
        ragvit.attention(*args, cu_seqlens, out=CAIOnly(out, version=version))
    torch.cuda.synchronize()
    assert torch.isnan(out_buffer).all()


@pytest.mark.gpu
@requires_cuda
def test_cai_read_only_output_is_refused(gen):
    q, k, v, cu_seqlens, out_buffer, _ = _qkv_problem(gen, torch.float16, "cuda")
    out = out_buffer[:, 0]
    with pytest.raises(ValueError, match=r"read-only|read only"):
        ragvit.attention(
            *(CAIOnly(t) for t in (q, k, v, cu_seqlens)), out=CAIOnly(out, read_only=True)
        )
    torch.cuda.synchronize()
    assert torch.isnan(out_buffer).all()


@pytest.mark.gpu
@requires_cuda
def test_cai_v3_stream_is_waited_on(gen, seed):
    q_src, k, v, cu_seqlens, out_buffer, _ = _qkv_problem(
        gen, torch.float16, "cuda", lengths=(197, 1, 64)
    )
    out = out_buffer[:, 0]
    q = torch.zeros_like(q_src)  # what a launch that ignores the stream would read
    torch.cuda.synchronize()
    producer_stream = torch.cuda.Stream()
    with torch.cuda.stream(producer_stream):
        torch.cuda._sleep(200_000_000)
        q.copy_(q_src)
    handle = producer_stream.cuda_stream
    args = [CAIOnly(t, version=3, stream=handle) for t in (q, k, v, cu_seqlens, out)]
    ragvit.attention(*args[:4], out=args[4])  # no torch tensor: the CAI stream decides
    torch.cuda.synchronize()
    _assert_fakes_used(args)
    check_attention(out, q_src, k, v, cu_seqlens, seed=seed)


@pytest.mark.gpu
@requires_cuda
def test_cai_strides_are_bytes(gen, seed):
    """Token stride 3*H*D elements = 6*H*D bytes for fp16: read as elements it
    would run far past the buffer (memcheck) or mix heads."""
    q, k, v, cu_seqlens, out_buffer, _ = _qkv_problem(gen, torch.float16, "cuda")
    out = out_buffer[:, 0]
    cai = CAIOnly(q).__cuda_array_interface__
    assert cai["strides"] == tuple(s * 2 for s in q.stride())
    ragvit.attention(*(CAIOnly(t) for t in (q, k, v, cu_seqlens)), out=CAIOnly(out))
    torch.cuda.synchronize()
    check_attention(out, q, k, v, cu_seqlens, seed=seed)


def test_fake_classes_are_faithful():
    """Guards the fakes themselves against the producers they imitate."""
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert capsule_name(VersionedOnly(array).__dlpack__(max_version=(1, 0))) == _NAME_VERSIONED
    with pytest.raises(BufferError):
        VersionedOnly(array).__dlpack__()
    assert capsule_name(LegacyOnly(array).__dlpack__()) == _NAME_LEGACY
    with pytest.raises(TypeError):
        LegacyOnly(array).__dlpack__(max_version=(1, 0))
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)[:, 1:]
    for versioned in (True, False):
        producer = CtypesProducer(t, versioned=versioned)
        capsule = producer.__dlpack__(max_version=(1, 0))
        round_trip = torch.from_dlpack(capsule)  # torch consumes it and later calls the deleter
        assert torch.equal(round_trip, t) and round_trip.stride() == t.stride()
        del round_trip
        gc.collect()
        assert producer.deleted == 1 and producer.bad_deletes == 0 and not producer.live
    assert same_bits(poison((2,)), poison((2,)))


def test_launch_empty_takes_any_call_shape():
    """The benchmarks call the floor with the op's exact call shape: extra positional and
    keyword arguments are ignored; device and stream still parse as before."""
    extra = (torch.zeros(2), torch.zeros(2), torch.zeros(2))
    if ragvit.cuda_available():
        stream = torch.cuda.current_stream().cuda_stream
        assert ragvit._C._launch_empty(0, stream, *extra, out=extra[0]) is None
        assert ragvit._C._launch_empty(0, stream, *extra) is None
        assert ragvit._C._launch_empty() is None
        torch.cuda.synchronize()
    else:  # a CPU-only build says so; a CUDA build without a usable device reports CUDA's error
        pattern = "cudaError" if ragvit.cuda_is_compiled() else "CUDA build"
        with pytest.raises(RuntimeError, match=pattern):
            ragvit._C._launch_empty(0, 0, *extra, out=extra[0])
    with pytest.raises(TypeError, match="multiple values for argument 'stream'"):
        ragvit._C._launch_empty(0, 0, stream=0)
    with pytest.raises(TypeError):
        ragvit._C._launch_empty("cuda:0")


# ---- import safety: what producers and callers can break ----


def _safety_problem(device="cpu"):
    """q, k, v (12, 2, 32) float32, cu_seqlens [5, 7], a poisoned out, and copies of all of
    them for the byte-identical check after a refusal."""
    q, k, v, cu_seqlens, out = _refusal_problem(device)
    return {"q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens, "out": out}


def _attention(a):
    return ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"], out=a["out"])


def _freed(t):
    """t with its storage freed (resize_(0)): shape and strides stay, data is NULL."""
    t = t.clone()
    t.untyped_storage().resize_(0)
    return t


NULL_DATA_CASES = [
    pytest.param("q", _freed, id="q_freed_storage"),
    pytest.param("out", _freed, id="out_freed_storage"),
    pytest.param("q", lambda t: CtypesProducer(t, null_data=True), id="q_capsule_null_data"),
    pytest.param("out", lambda t: CtypesProducer(t, null_data=True, versioned=False),
                 id="out_legacy_capsule_null_data"),
]


@pytest.mark.parametrize("name, make", NULL_DATA_CASES)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu_marks())])
def test_null_data_with_elements_is_refused(name, make, device):
    a = _safety_problem(device)
    watched = {n: t.clone() for n, t in a.items()}
    a[name] = make(a[name])
    with pytest.raises(BufferError, match=rf"attention: {name} must have data, got a NULL data"):
        _attention(a)
    for n, before in watched.items():
        if n != name:
            assert same_bits(a[n], before), f"rejected call modified {n}"


def test_fake_tensor_is_refused():
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    a = _safety_problem()
    with fake_tensor.FakeTensorMode():
        fake = torch.empty(a["q"].shape)
    with pytest.raises(BufferError, match=r"attention: q must have data"):
        ragvit.attention(fake, a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    assert torch.isnan(a["out"]).all()


def test_capsule_with_null_shape_is_refused():
    a = _safety_problem()
    producer = CtypesProducer(a["q"], null_shape=True)
    with pytest.raises(BufferError, match=r"attention: q must have a DLPack shape, got NULL"):
        ragvit.attention(producer, a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    assert torch.isnan(a["out"]).all()
    assert producer.bad_deletes == 0


@pytest.mark.parametrize("shape, dim, extent", [
    ((-1, 2, 32), 0, -1),
    ((1, -2, 32), 1, -2),
    ((2**40, 2**20, 2**4), 2, 2**4),  # the product passes 2**63 at the last dimension
], ids=["negative_first", "negative_middle", "product_overflows"])
def test_capsule_with_impossible_shape_is_refused(shape, dim, extent):
    a = _safety_problem()
    producer = CtypesProducer(a["q"], shape=shape)
    with pytest.raises(BufferError, match=rf"attention: q must have non-negative dimensions "
                                          rf"whose nonzero product fits in 64 bits, got "
                                          rf"dimension {dim} = {extent}$"):
        ragvit.attention(producer, a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    assert torch.isnan(a["out"]).all()
    assert producer.bad_deletes == 0


def test_empty_capsule_with_huge_extents_is_refused():
    """A zero extent empties the array, but its other extents still size its strides and
    byte span: their product must fit too."""
    q = torch.empty((0, 2, 32))
    cu_seqlens = torch.zeros(1 + 1, dtype=torch.int32)
    out = torch.full((0, 2, 32), torch.nan)
    producer = CtypesProducer(q, shape=(0, 2**62, 2**62))
    with pytest.raises(BufferError, match=r"attention: q must have non-negative dimensions "
                                          r"whose nonzero product fits in 64 bits, got "
                                          rf"dimension 2 = {2**62}$"):
        ragvit.attention(producer, q, q, cu_seqlens, out=out)
    assert producer.bad_deletes == 0


def test_empty_capsule_may_have_null_data():
    """DLPack allows data == NULL when there are no elements."""
    q = torch.empty((0, 2, 32))
    cu_seqlens = torch.zeros(1 + 1, dtype=torch.int32)
    out = torch.empty((0, 2, 32))
    producer = CtypesProducer(q, null_data=True)
    assert ragvit.attention(producer, q, q, cu_seqlens, out=out) is out
    _assert_fakes_used([producer])


# Use after free across arguments: a later argument's protocol runs Python code that frees
# or resizes an earlier argument. Every protocol runs before any raw view is taken, so the
# call sees the arrays as they are after that code, never the freed memory.


class FreesOnExport:
    """A DLPack producer whose __dlpack__ first runs `action` (freeing another argument)."""

    def __init__(self, array, action):
        self.inner = VersionedOnly(array)
        self.action = action

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        self.action()
        return self.inner.__dlpack__(**kwargs)


def test_numpy_input_resized_by_a_later_argument():
    a = _safety_problem()
    q = a["q"].numpy().copy()
    victim = FreesOnExport(a["k"].numpy(), lambda: q.resize((0,), refcheck=False))
    with pytest.raises(ValueError, match=r"attention: .*q"):
        ragvit.attention(q, victim, a["v"], a["cu_seqlens"], out=a["out"])
    assert torch.isnan(a["out"]).all()


def test_torch_input_freed_by_a_later_argument():
    a = _safety_problem()
    q = a["q"].clone()
    victim = FreesOnExport(a["k"].numpy(), lambda: q.untyped_storage().resize_(0))
    with pytest.raises(BufferError, match=r"attention: q must have data"):
        ragvit.attention(q, victim, a["v"], a["cu_seqlens"], out=a["out"])
    assert torch.isnan(a["out"]).all()


def test_torch_output_replaced_by_a_later_argument():
    """out.set_() from cls_attn's export: the call writes the new storage, not the old."""
    a = _safety_problem()
    out = poison(a["q"].shape)
    fresh = poison(a["q"].shape)
    old_storage = out.untyped_storage()
    old = torch.empty(0).set_(old_storage, 0, out.shape, out.stride())
    cls_attn = FreesOnExport(poison((12,)).numpy(), lambda: out.set_(fresh))
    ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"], out=out, cls_attn=cls_attn)
    assert torch.isnan(old).all(), "the call wrote the storage out had before set_()"
    check_attention(fresh, a["q"], a["k"], a["v"], a["cu_seqlens"], seed=0)


@pytest.mark.gpu
@requires_cuda
def test_cuda_input_freed_by_a_later_argument():
    a = _safety_problem("cuda")
    q = a["q"].clone()
    victim = FreesOnExport(a["k"], lambda: q.untyped_storage().resize_(0))
    with pytest.raises(BufferError, match=r"attention: q must have data"):
        ragvit.attention(q, victim, a["v"], a["cu_seqlens"], out=a["out"])
    torch.cuda.synchronize()
    assert torch.isnan(a["out"]).all()


# ---- producers' own exceptions propagate unchanged ----


class ProducerError(Exception):
    pass


class RaisesIn:
    """An object whose `attr` (a property) raises `error`."""

    def __init__(self, attr, error):
        self.attr = attr
        self.error = error

    def __getattr__(self, name):
        if name == self.attr:
            raise self.error
        raise AttributeError(name)


@pytest.mark.parametrize("attr", ["__dlpack__", "__cuda_array_interface__"])
@pytest.mark.parametrize("error", [ProducerError("boom"), KeyboardInterrupt()],
                         ids=["producer_error", "keyboard_interrupt"])
def test_producer_exceptions_propagate(attr, error):
    a = _safety_problem()
    with pytest.raises(type(error)):
        ragvit.attention(RaisesIn(attr, error), a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    assert torch.isnan(a["out"]).all()


def test_dlpack_export_error_propagates_unchanged():
    class Refuses(VersionedOnly):
        def __dlpack__(self, **kwargs):
            raise ProducerError("cannot export")

    a = _safety_problem()
    with pytest.raises(ProducerError, match="cannot export"):
        ragvit.attention(Refuses(a["q"].numpy()), a["k"], a["v"], a["cu_seqlens"], out=a["out"])


def test_stream_object_errors_propagate():
    class BadStream:
        def __getattr__(self, name):
            raise ProducerError(name)

    a = _safety_problem()
    with pytest.raises(ProducerError, match="__cuda_stream__"):
        ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"], out=a["out"], stream=BadStream())


# ---- a DLPack C exchange API built by hand (ctypes) ----


class _ExchangeHeader(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("prev_api", ctypes.c_void_p)]


class _ExchangeAPI(ctypes.Structure):
    _fields_ = [
        ("header", _ExchangeHeader),
        ("managed_tensor_allocator", ctypes.c_void_p),
        ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
        ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
        ("dltensor_from_py_object_no_sync", ctypes.c_void_p),
        ("current_work_stream", ctypes.c_void_p),
    ]


_DLTENSOR_FROM_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_DLTensor))
_MANAGED_FROM_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WORK_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p)
_LIVE_EXCHANGE = {}  # id(obj) -> (obj, shape, strides) while a view of it may be read


def _fill_dltensor(address, out):
    obj = _LIVE_EXCHANGE[address][0]
    t = obj.tensor
    shape = (ctypes.c_int64 * t.dim())(*t.shape)
    strides = (ctypes.c_int64 * t.dim())(*t.stride())
    _LIVE_EXCHANGE[address] = (obj, shape, strides)
    code, bits = _DL_DTYPES[t.dtype]
    out[0] = _DLTensor(t.data_ptr(), _DLDevice(kDLCPU, 0), t.dim(), _DLDataType(code, bits, 1),
                       ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
                       ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0)
    return 0


_CALLBACKS = {
    "dltensor_ok": _DLTENSOR_FROM_PY(_fill_dltensor),
    "dltensor_fails_silently": _DLTENSOR_FROM_PY(lambda address, out: -1),
    "managed_fails_silently": _MANAGED_FROM_PY(lambda address, out: -1),
    "stream_ok": _WORK_STREAM(lambda device_type, device_id, out: 0),
}


def _exchange_type(name, *, dltensor, managed="managed_fails_silently"):
    """A class whose type offers a hand-built exchange API table: no allocator, the named
    callbacks. The table and the class live for the process (the spec's rule)."""
    table = _ExchangeAPI()
    table.header.version = _DLPackVersion(1, 3)
    table.managed_tensor_from_py_object_no_sync = ctypes.cast(_CALLBACKS[managed],
                                                              ctypes.c_void_p)
    table.dltensor_from_py_object_no_sync = (
        ctypes.cast(_CALLBACKS[dltensor], ctypes.c_void_p) if dltensor else None
    )
    table.current_work_stream = ctypes.cast(_CALLBACKS["stream_ok"], ctypes.c_void_p)
    capsule = _capsule_new(ctypes.addressof(table), b"dlpack_exchange_api", None)

    def __init__(self, tensor):
        self.tensor = tensor
        _LIVE_EXCHANGE[id(self)] = (self, None, None)

    cls = type(name, (), {"__init__": __init__, "__dlpack_c_exchange_api__": capsule,
                          "_table": table})
    return cls


_EXCHANGE_OK = _exchange_type("ExchangeNoAllocator", dltensor="dltensor_ok")
_EXCHANGE_SILENT = _exchange_type("ExchangeFailsSilently", dltensor="dltensor_fails_silently")
_EXCHANGE_MANAGED_SILENT = _exchange_type("ExchangeManagedFailsSilently", dltensor=None)


def test_exchange_api_without_allocator_allocates_a_buffer_on_the_host(gen, seed):
    q, k, v, cu_seqlens, _, _ = _qkv_problem(gen, torch.float32, "cpu", tail=0)
    args = [_EXCHANGE_OK(t) for t in (q, k, v, cu_seqlens)]
    result = ragvit.attention(*args)
    assert isinstance(result, ragvit.Buffer)
    covered = covered_rows(cu_seqlens, q.shape[0])
    torch.testing.assert_close(torch.from_dlpack(result).double()[covered],
                               attention_reference(q, k, v, cu_seqlens)[covered],
                               **TOL[torch.float32])


@pytest.mark.parametrize("cls, callback", [
    (_EXCHANGE_SILENT, "dltensor_from_py_object_no_sync"),
    (_EXCHANGE_MANAGED_SILENT, "managed_tensor_from_py_object_no_sync"),
], ids=["dltensor", "managed"])
def test_exchange_callback_failing_without_an_error_is_a_buffer_error(cls, callback):
    a = _safety_problem()
    with pytest.raises(BufferError, match=rf"attention: q must be importable, got a failing "
                                          rf"{callback} that set no error"):
        ragvit.attention(cls(a["q"]), a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    assert torch.isnan(a["out"]).all()


class _DLPackOnly:
    """A user's heap type that speaks __dlpack__ alone, delegating to a torch tensor."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def test_a_heap_type_gaining_an_exchange_api_is_seen_on_the_next_call(seed):
    """What ragvit remembers about a heap type without an exchange API lasts only while the
    type is unchanged: a class that gains one after a call is imported through it."""
    cls = type("LateExchange", (_DLPackOnly,), {})
    a = _safety_problem()
    ragvit.attention(cls(a["q"]), a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    check_attention(a["out"], a["q"], a["k"], a["v"], a["cu_seqlens"], seed=seed)
    ragvit.attention(cls(a["q"]), a["k"], a["v"], a["cu_seqlens"], out=a["out"])  # remembered
    cls.__dlpack_c_exchange_api__ = _EXCHANGE_SILENT.__dlpack_c_exchange_api__
    a["out"].fill_(float("nan"))
    with pytest.raises(BufferError, match="attention: q must be importable, got a failing "
                                          "dltensor_from_py_object_no_sync that set no error"):
        ragvit.attention(cls(a["q"]), a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    assert torch.isnan(a["out"]).all()


def test_a_heap_type_seen_as_an_argument_is_not_kept_alive():
    cls = type("Passing", (_DLPackOnly,), {})
    a = _safety_problem()
    for _ in range(2):
        ragvit.attention(cls(a["q"]), a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    ref = weakref.ref(cls)
    del cls
    gc.collect()
    assert ref() is None


def test_many_heap_types_in_turn_each_import_as_their_own(seed):
    """More heap types than ragvit remembers, each called twice in turn: every call reads its
    own argument."""
    a = _safety_problem()
    classes = [type(f"Turn{i}", (_DLPackOnly,), {}) for i in range(20)]
    for _ in range(2):
        for i, cls in enumerate(classes):
            q = a["q"] * (1 + i / 8)
            ragvit.attention(cls(q), a["k"], a["v"], a["cu_seqlens"], out=a["out"])
            check_attention(a["out"], q, a["k"], a["v"], a["cu_seqlens"], seed=seed)


# ---- torch's negative bit ----


NEG_CASES = [
    pytest.param("q", lambda t: torch._neg_view(t), id="q_neg_view"),
    pytest.param("k", lambda t: torch.complex(torch.zeros_like(t), t).conj().imag,
                 id="k_conj_imag"),
    pytest.param("out", lambda t: torch._neg_view(t), id="out_neg_view"),
]


@pytest.mark.parametrize("name, make", NEG_CASES)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu_marks())])
def test_negative_bit_is_refused_in_debug_mode(name, make, device):
    ragvit.set_debug(True)  # the autouse fixture restores the switch
    a = _safety_problem(device)
    a[name] = make(a[name])
    assert a[name].is_neg()
    watched = {n: t.resolve_neg().clone() for n, t in a.items()}
    with pytest.raises(BufferError, match=rf"attention: {name} must not have torch's negative "
                                          r"bit set.*\.resolve_neg\(\)"):
        _attention(a)
    for n, before in watched.items():
        assert same_bits(a[n].resolve_neg(), before), f"rejected call modified {n}"


def test_negative_bit_is_not_asked_outside_debug_mode(seed):
    """Outside debug mode the bit is not asked (torch's is_neg would cost every call about a
    third more host time): the view is read as its memory holds it, as torch's own
    __dlpack__ reads it, which is why the docs say to call .resolve_neg() first."""
    ragvit.set_debug(False)
    a = _safety_problem()
    q = a["q"].clone()
    ragvit.attention(torch._neg_view(q), a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    check_attention(a["out"], q, a["k"], a["v"], a["cu_seqlens"], seed=seed)


def test_resolved_negative_bit_is_accepted(seed):
    a = _safety_problem()
    q = torch._neg_view(-a["q"]).resolve_neg()
    ragvit.attention(q, a["k"], a["v"], a["cu_seqlens"], out=a["out"])
    check_attention(a["out"], a["q"], a["k"], a["v"], a["cu_seqlens"], seed=seed)


# ---- autograd: outputs written through out= bump their version counter ----


def _saved_for_backward(t):
    """y = (w * t).sum() saves t for backward; y.backward() then checks t's version."""
    w = torch.ones_like(t, requires_grad=True)
    return (w * t).sum()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu_marks())])
def test_out_saved_for_backward_is_detected(device):
    a = _safety_problem(device)
    y = _saved_for_backward(a["out"])
    _attention(a)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_out_is_not_bumped_outside_grad_mode(mode):
    """Under torch.no_grad() or inference_mode no backward is being recorded and the bump
    (a seventh of a call's host cost) is skipped, as docs/interop.md says: a write there
    into a tensor saved earlier in grad mode is not caught."""
    a = _safety_problem()
    before = a["out"]._version
    with getattr(torch, mode)():
        _attention(a)
    assert a["out"]._version == before
    assert not torch.isnan(a["out"]).any()


def _row_args():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn((5, 12), generator=gen)
    return x, torch.randn((12,), generator=gen), torch.randn((12,), generator=gen)


def _bump_cases():
    """(op, call(outputs), outputs): every op that writes caller-given tensors, with the
    tensors it writes."""
    x, w, b = _row_args()
    packed = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6)
    cu = make_cu_seqlens([5, 0, 7], "cpu")
    keep = torch.ones((2, 3), dtype=torch.bool)
    padded = torch.randn((2, 3, 6))
    a = _safety_problem()
    q, k, v, cu2 = a["q"], a["k"], a["v"], a["cu_seqlens"]
    i64 = torch.int64
    return [
        ("attention", lambda o: ragvit.attention(q, k, v, cu2, out=o[0], cls_attn=o[1]),
         [poison(q.shape), poison((12,))]),
        ("layer_norm", lambda o: ragvit.layer_norm(x, w, b, out=o[0]), [poison((5, 12))]),
        ("gelu", lambda o: ragvit.gelu(x, out=o[0]), [poison((5, 12))]),
        ("linear", lambda o: ragvit.linear(x, torch.randn(12, 12), out=o[0]), [poison((5, 12))]),
        ("pack_into", lambda o: ragvit.pack_into(padded, keep, o[0], o[1], indices=o[2]),
         [poison((12, 6)), poison((3,), torch.int32), poison((12,), torch.int32)]),
        ("unpack", lambda o: ragvit.unpack(packed, cu, 7, out=o[0]), [poison((3, 7, 6))]),
        ("gather_prefix", lambda o: ragvit.gather_prefix(packed, cu2, 1, out=o[0]),
         [poison((2, 1, 6))]),
        ("segment_mean", lambda o: ragvit.segment_mean(packed, cu, out=o[0]), [poison((3, 6))]),
        ("topk_index", lambda o: ragvit.topk_index(x, 3, out=o[0]),
         [torch.empty((5, 3), dtype=i64)]),
    ]


@pytest.mark.parametrize("op, call, outputs", [pytest.param(*c, id=c[0]) for c in _bump_cases()])
def test_every_written_output_is_bumped(op, call, outputs):
    before = [t._version for t in outputs]
    call(outputs)
    after = [t._version for t in outputs]
    assert all(new > old for new, old in zip(after, before, strict=True)), (
        f"{op} did not bump every output it wrote: {before} -> {after}"
    )


def _grad_cases():
    """(op, argument, call(inputs, out), out): every op with a float array that can require
    grad, inputs as a dict (the named one, an input or an output, is made to require grad),
    out a poisoned output to check, or None."""
    x, w, b = _row_args()
    packed = torch.randn((12, 6), generator=torch.Generator().manual_seed(3))
    cu = make_cu_seqlens([5, 0, 7], "cpu")
    keep = torch.ones(12, dtype=torch.bool)
    padded = torch.randn((2, 3, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones((2, 3), dtype=torch.bool)
    a = _safety_problem()
    return [
        ("attention", "q", {"q": a["q"], "k": a["k"], "v": a["v"]}, lambda t, o: ragvit.attention(
            t["q"], t["k"], t["v"], a["cu_seqlens"], out=o), poison(a["q"].shape)),
        ("attention", "bias", {"bias": torch.zeros(12)}, lambda t, o: ragvit.attention(
            a["q"], a["k"], a["v"], a["cu_seqlens"], bias=t["bias"], out=o),
         poison(a["q"].shape)),
        ("linear", "weight", {"weight": torch.randn(12, 12)},
         lambda t, o: ragvit.linear(x, t["weight"], out=o), poison((5, 12))),
        ("linear", "residual", {"residual": torch.randn(5, 12)},
         lambda t, o: ragvit.linear(x, torch.randn(12, 12), residual=t["residual"], out=o),
         poison((5, 12))),
        ("layer_norm", "weight", {"weight": w}, lambda t, o: ragvit.layer_norm(x, t["weight"], b,
                                                                               out=o),
         poison((5, 12))),
        ("gelu", "x", {"x": x}, lambda t, o: ragvit.gelu(t["x"], out=o), poison((5, 12))),
        ("gelu", "out", {"out": poison((5, 12))}, lambda t, o: ragvit.gelu(x, out=t["out"]),
         None),
        ("attention", "cls_attn", {"cls_attn": poison((12,))}, lambda t, o: ragvit.attention(
            a["q"], a["k"], a["v"], a["cu_seqlens"], cls_attn=t["cls_attn"], out=o),
         poison(a["q"].shape)),
        ("repack", "packed", {"packed": packed},
         lambda t, o: ragvit.repack(t["packed"], cu, keep), None),
        ("repack_into", "fuse_weights", {"fuse_weights": torch.ones(12)},
         lambda t, o: ragvit.repack_into(packed, cu, keep, o, torch.empty(4, dtype=torch.int32),
                                         fuse_weights=t["fuse_weights"]), poison((15, 6))),
        ("pack", "x", {"x": padded}, lambda t, o: ragvit.pack(t["x"], mask), None),
        ("pack_into", "x", {"x": padded}, lambda t, o: ragvit.pack_into(
            t["x"], mask, o, torch.empty(3, dtype=torch.int32)), poison((6, 6))),
        ("unpack", "packed", {"packed": packed},
         lambda t, o: ragvit.unpack(t["packed"], cu, 7, out=o), poison((3, 7, 6))),
        ("gather_prefix", "packed", {"packed": packed},
         lambda t, o: ragvit.gather_prefix(t["packed"], a["cu_seqlens"], 1, out=o),
         poison((2, 1, 6))),
        ("segment_mean", "packed", {"packed": packed},
         lambda t, o: ragvit.segment_mean(t["packed"], cu, out=o), poison((3, 6))),
        ("topk_index", "scores", {"scores": x}, lambda t, o: ragvit.topk_index(t["scores"], 3),
         None),
        ("torch.ops.ragvit.attention", "q", {"q": a["q"], "k": a["k"], "v": a["v"]},
         lambda t, o: torch.ops.ragvit.attention(t["q"], t["k"], t["v"], a["cu_seqlens"], 7),
         None),
    ]


@pytest.mark.parametrize("op, arg, inputs, call, out",
                         [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in _grad_cases()])
def test_arrays_requiring_grad_refused_in_grad_mode(op, arg, inputs, call, out):
    """ragvit's ops have no backward: an array that requires grad in grad mode is refused,
    naming the op and the argument, before anything is written (an input's gradient would
    stop at the output without a word; an output's would be taken for the values it held
    before); under torch.no_grad() and inference_mode the same call runs."""
    import ragvit.library  # noqa: F401 - registers torch.ops.ragvit

    inputs = {name: t.clone() for name, t in inputs.items()}
    inputs[arg].requires_grad_(True)
    before = out.clone() if out is not None else None
    name = op.removeprefix("torch.ops.ragvit.")
    with pytest.raises(RuntimeError, match=f"{name}: {arg} requires grad and grad mode is on, "
                       f"but ragvit's ops have no backward: .* or pass {arg}.detach\\(\\)"):
        call(inputs, out)
    if out is not None:
        assert same_bits(out, before), f"{op} wrote its output before refusing"
    with torch.no_grad():
        call(inputs, out)
    with torch.inference_mode():
        call(inputs, out)
    detached = {name: t.detach() for name, t in inputs.items()}
    call(detached, out)  # grad mode, nothing requires grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu_marks())])
@pytest.mark.parametrize("arg", ["q", "v", "out"])
def test_attention_array_requiring_grad_refused_on_every_device(device, arg):
    """The refusal is the glue's, before any import or launch: the same on CUDA tensors,
    and out= stays as it was."""
    a = _safety_problem(device)
    a[arg] = a[arg].clone().requires_grad_(True)
    before = a["out"].clone()
    with pytest.raises(RuntimeError, match=f"attention: {arg} requires grad and grad mode is on"):
        _attention(a)
    assert same_bits(a["out"], before)
    with torch.no_grad():
        _attention(a)
    assert not torch.isnan(a["out"][:12]).any()


def test_inputs_and_allocated_outputs_are_not_bumped():
    a = _safety_problem()
    before = [a[n]._version for n in ("q", "k", "v", "cu_seqlens")]
    result = ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"])
    assert [a[n]._version for n in ("q", "k", "v", "cu_seqlens")] == before
    assert result._version == 0


def test_inference_tensor_out_is_accepted(seed):
    a = _safety_problem()
    with torch.inference_mode():
        out = poison(a["q"].shape)
    ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"], out=out)
    check_attention(out, a["q"], a["k"], a["v"], a["cu_seqlens"], seed=seed)


# ---- the type cache keeps no user class alive ----


def test_classes_without_an_exchange_api_are_not_kept_alive():
    a = _safety_problem()
    refs = []
    for i in range(2 * 8):  # more classes than the cache holds
        cls = type(f"Producer{i}", (VersionedOnly,), {})
        ragvit.attention(cls(a["q"].numpy()), a["k"], a["v"], a["cu_seqlens"], out=a["out"])
        refs.append(weakref.ref(cls))
        del cls
    gc.collect()
    assert all(r() is None for r in refs), "ragvit kept a producer class alive"


# ---- the GIL is released around large host calls ----


def test_other_threads_run_during_a_long_host_call():
    """A thread spinning in Python advances during a long CPU attention call at a good share
    of the rate it has while the main thread sleeps (holding the GIL it would advance only
    for one switch interval, a few percent of the call)."""
    import threading
    import time

    gen = torch.Generator().manual_seed(3)
    total = 1536
    q, k, v = make_qkv(gen, total, 4, 64, torch.float32, "cpu")
    cu_seqlens = make_cu_seqlens([total], "cpu")
    out = torch.empty_like(q)
    ragvit.attention(q, k, v, cu_seqlens, out=out)  # warm
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        while counter[0] == 0:
            pass
        shares = []
        for _ in range(3):
            before, start = counter[0], time.perf_counter()
            time.sleep(0.05)
            rate = (counter[0] - before) / (time.perf_counter() - start)
            before, start = counter[0], time.perf_counter()
            ragvit.attention(q, k, v, cu_seqlens, out=out)
            shares.append((counter[0] - before) / (rate * (time.perf_counter() - start)))
    finally:
        stop.set()
        thread.join()
    assert max(shares) > 0.3, f"the other thread ran {shares} of its free rate during the calls"


# ---- integer scalars through __index__ ----


def test_numpy_integers_are_accepted_for_counts_and_max_seqlen(seed):
    a = _safety_problem()
    cu = a["cu_seqlens"].numpy()
    max_seqlen = np.diff(cu).max()
    assert isinstance(max_seqlen, np.integer)
    ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"], max_seqlen, out=a["out"])
    check_attention(a["out"], a["q"], a["k"], a["v"], a["cu_seqlens"], seed=seed)
    packed = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6)
    got = ragvit.gather_prefix(packed, a["cu_seqlens"], np.int64(2))
    assert torch.equal(got, ragvit.gather_prefix(packed, a["cu_seqlens"], 2))
    scores = torch.randn((3, 10))
    assert torch.equal(ragvit.topk_index(scores, np.int32(4), prefix=np.int16(1)),
                       ragvit.topk_index(scores, 4, prefix=1))


@pytest.mark.parametrize("value, exc, pattern", [
    (True, TypeError, r"gather_prefix: k must be an int, got bool"),
    (np.bool_(True), TypeError, r"gather_prefix: k must be an int, got numpy\.bool"),
    (2.0, TypeError, r"gather_prefix: k must be an int, got float"),
    (np.int64(-1), ValueError, r"gather_prefix: k must be in \[0, 2\*\*31\), got -1"),
])
def test_counts_refuse_what_is_not_an_index(value, exc, pattern):
    a = _safety_problem()
    packed = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6)
    out = poison((2, 1, 6))
    with pytest.raises(exc, match=pattern):
        ragvit.gather_prefix(packed, a["cu_seqlens"], value, out=out)
    assert torch.isnan(out).all()


def test_index_errors_propagate():
    class BadIndex:
        def __index__(self):
            raise ProducerError("index")

    a = _safety_problem()
    with pytest.raises(ProducerError, match="index"):
        ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"], BadIndex(), out=a["out"])
    assert torch.isnan(a["out"]).all()


# ---- empty NumPy arrays (NumPy 2 reports zero strides for them) ----


def test_empty_numpy_arrays_are_accepted():
    q = np.empty((0, 2, 32), np.float32)
    assert q.strides == (0, 0, 0) or q.size == 0
    result = ragvit.attention(q, q, q, np.zeros(2, np.int32))
    assert isinstance(result, np.ndarray) and result.shape == (0, 2, 32)
    packed, cu_seqlens, index = ragvit.pack(np.ones((2, 3, 4), np.float32),
                                            np.zeros((2, 3), bool))
    assert packed.shape == (0, 4) and index.shape == (0,)
    assert cu_seqlens.tolist() == [0, 0, 0]
    out, cu_out, src = np.empty((0, 4), np.float32), np.empty(3, np.int32), np.empty(0, np.int32)
    ragvit.pack_into(np.ones((2, 3, 4), np.float32), np.zeros((2, 3), bool), out, cu_out,
                     indices=src)
    assert cu_out.tolist() == [0, 0, 0]
