"""ragvit's array ops as torch custom ops, torch.ops.ragvit.<op>: torch.compile and torch.export.

Importing this module (ragvit.timm_patch does; `import ragvit` alone does not: torch stays
optional) registers each public array op under its Python name: a functional overload, plus an
`.out` overload where the Python op takes out= (`Tensor(o!) out`, returns nothing, so
functionalization keeps the rows an op leaves untouched); attention's cls_attn output has
`.cls_attn` and `.cls_attn_out`; `uniform_cu_seqlens` gives traced forwards the cu_seqlens of
equal-length sequences as one shared buffer. Real kernels call ragvit._C; fake kernels give
contiguous outputs (pack, repack: an unbacked row count). This module's functions take the
Python ops' arguments. Decision that is not obvious: Dynamo cannot trace a C function, so each
function is also the polyfill of its ragvit._C entry point
(torch.compiler.substitute_in_graph): in a compiled function a ragvit op traces as its torch
op, while eager calls go straight to C as before; non-strict torch.export runs no Dynamo, so
routed_ops() swaps the ops while it traces.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from . import _C

__all__ = [
    "OPS", "attention", "gather_prefix", "gelu", "layer_norm", "linear", "pack", "pack_into",
    "repack", "repack_into", "routed_ops", "segment_mean", "topk_index", "uniform_cu_seqlens",
    "unpack",
]

# The ops registered here: every public array op of ragvit.ops.
OPS = ("attention", "pack", "pack_into", "unpack", "repack", "repack_into", "gather_prefix",
       "segment_mean", "linear", "layer_norm", "gelu", "topk_index")

_LIB = torch.library.Library("ragvit", "DEF")

# Functional schema and out schema (None: the op has no out= form) of every op. Out forms
# append `*, Tensor(o!) out` (kwarg-only) and return nothing.
_SCHEMAS = {
    "attention": "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt? max_seqlen=None, *, "
                 "float? scale=None, Tensor? bias=None{out})",
    "pack": "(Tensor x, Tensor keep) -> (Tensor, Tensor, Tensor)",
    "pack_into": "(Tensor x, Tensor keep, Tensor(o!) out, Tensor(u!) cu_seqlens, *, "
                 "Tensor(i!)? indices=None) -> ()",
    "unpack": "(Tensor packed, Tensor cu_seqlens, SymInt N, *, Tensor? indices=None, "
              "float fill=0.0{out})",
    "repack": "(Tensor packed, Tensor cu_seqlens, Tensor keep, *, Tensor? fuse_weights=None) "
              "-> (Tensor, Tensor, Tensor)",
    "repack_into": "(Tensor packed, Tensor cu_seqlens, Tensor keep, Tensor(o!) out, "
                   "Tensor(u!) cu_seqlens_out, *, Tensor(s!)? src=None, "
                   "Tensor? fuse_weights=None) -> ()",
    "gather_prefix": "(Tensor packed, Tensor cu_seqlens, SymInt k{out})",
    "segment_mean": "(Tensor packed, Tensor cu_seqlens, *, SymInt skip=0{out})",
    "linear": "(Tensor x, Tensor weight, Tensor? bias=None, *, Tensor? residual=None{out})",
    "layer_norm": "(Tensor x, Tensor? weight=None, Tensor? bias=None, *, float eps=1e-05{out})",
    "gelu": "(Tensor x{out})",
    "topk_index": "(Tensor scores, SymInt k, *, SymInt prefix=0{out})",
}


def _define() -> None:
    for name in OPS:
        schema = _SCHEMAS[name]
        if "{out}" not in schema:
            _LIB.define(name + schema)
            continue
        _LIB.define(name + schema.format(out="") + " -> Tensor")
        star = "" if ", *," in schema else ", *"
        _LIB.define(f"{name}.out" + schema.format(out=f"{star}, Tensor(o!) out") + " -> ()")
    # attention's cls_attn output has overloads of its own: a functional op with an optional
    # mutable argument left None reached Inductor as a getitem it cannot lower (torch 2.14).
    _LIB.define("attention.cls_attn" + _SCHEMAS["attention"].format(
        out=", Tensor(c!) cls_attn") + " -> Tensor")
    _LIB.define("attention.cls_attn_out" + _SCHEMAS["attention"].format(
        out=", Tensor(c!) cls_attn, Tensor(o!) out") + " -> ()")
    _LIB.define("uniform_cu_seqlens(SymInt num_seqs, SymInt seq_len, Device device) -> Tensor")


_define()


# ---- real kernels: the C entry points ----


def _impl(name: str, overload: str = ""):
    qualname = f"ragvit::{name}" + (f".{overload}" if overload else "")

    def register(fn):
        torch.library.impl(qualname, "CompositeExplicitAutograd", lib=_LIB)(fn)
        return fn

    return register


def _out_kernel(c_op):
    """The .out kernel of a C op: the C call with out=, returning nothing."""

    def kernel(*args, out, **kwargs):
        c_op(*args, out=out, **kwargs)

    return kernel


@_impl("attention")
def _attention_kernel(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None, bias=None):
    return _C.attention(q, k, v, cu_seqlens, max_seqlen, scale=scale, bias=bias)


@_impl("attention", "cls_attn")
def _attention_cls_attn_kernel(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None,
                               bias=None, cls_attn):
    return _C.attention(q, k, v, cu_seqlens, max_seqlen, scale=scale, cls_attn=cls_attn,
                        bias=bias)


@_impl("attention", "cls_attn_out")
def _attention_cls_attn_out_kernel(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None,
                                   bias=None, cls_attn, out):
    _C.attention(q, k, v, cu_seqlens, max_seqlen, scale=scale, cls_attn=cls_attn, bias=bias,
                 out=out)


@_impl("uniform_cu_seqlens")
def _uniform_cu_seqlens_kernel(num_seqs, seq_len, device):
    return torch.arange(0, (num_seqs + 1) * seq_len, seq_len, dtype=torch.int32,
                        device=device)


@_impl("pack")
def _pack_kernel(x, keep):
    return _C.pack(x, keep)


@_impl("pack_into")
def _pack_into_kernel(x, keep, out, cu_seqlens, *, indices=None):
    _C.pack_into(x, keep, out, cu_seqlens, indices=indices)


@_impl("unpack")
def _unpack_kernel(packed, cu_seqlens, N, *, indices=None, fill=0.0):
    return _C.unpack(packed, cu_seqlens, N, indices=indices, fill=fill)


@_impl("repack")
def _repack_kernel(packed, cu_seqlens, keep, *, fuse_weights=None):
    return _C.repack(packed, cu_seqlens, keep, fuse_weights=fuse_weights)


@_impl("repack_into")
def _repack_into_kernel(packed, cu_seqlens, keep, out, cu_seqlens_out, *, src=None,
                        fuse_weights=None):
    _C.repack_into(packed, cu_seqlens, keep, out, cu_seqlens_out, src=src,
                   fuse_weights=fuse_weights)


@_impl("gather_prefix")
def _gather_prefix_kernel(packed, cu_seqlens, k):
    return _C.gather_prefix(packed, cu_seqlens, k)


@_impl("segment_mean")
def _segment_mean_kernel(packed, cu_seqlens, *, skip=0):
    return _C.segment_mean(packed, cu_seqlens, skip=skip)


@_impl("linear")
def _linear_kernel(x, weight, bias=None, *, residual=None):
    return _C.linear(x, weight, bias, residual=residual)


@_impl("layer_norm")
def _layer_norm_kernel(x, weight=None, bias=None, *, eps=1e-5):
    return _C.layer_norm(x, weight, bias, eps=eps)


@_impl("gelu")
def _gelu_kernel(x):
    return _C.gelu(x)


@_impl("topk_index")
def _topk_index_kernel(scores, k, *, prefix=0):
    return _C.topk_index(scores, k, prefix=prefix)


for _name in OPS:
    if "{out}" in _SCHEMAS[_name]:
        _impl(_name, "out")(_out_kernel(getattr(_C, _name)))


# ---- fake kernels: shapes, dtypes and strides (every output is contiguous, as C allocates) ----


def _fake(name: str):
    def register(fn):
        torch.library.register_fake(f"ragvit::{name}", fn, lib=_LIB)
        return fn

    return register


def _new(like: torch.Tensor, *shape, dtype=None) -> torch.Tensor:
    return like.new_empty(shape, dtype=like.dtype if dtype is None else dtype)


@_fake("attention")
def _attention_fake(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None, bias=None):
    return _new(q, *q.shape)


@_fake("attention.cls_attn")
def _attention_cls_attn_fake(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None, bias=None,
                             cls_attn):
    return _new(q, *q.shape)


def _dynamic_rows(capacity):
    """An unbacked row count in [0, capacity] (the bound only when capacity is static)."""
    ctx = torch.library.get_ctx()
    if isinstance(capacity, int):
        return ctx.new_dynamic_size(max=capacity)
    return ctx.new_dynamic_size()


@_fake("pack")
def _pack_fake(x, keep):
    B, N, C = x.shape
    T = _dynamic_rows(B * N)
    return _new(x, T, C), _new(x, B + 1, dtype=torch.int32), _new(x, T, dtype=torch.int32)


@_fake("unpack")
def _unpack_fake(packed, cu_seqlens, N, *, indices=None, fill=0.0):
    return _new(packed, cu_seqlens.shape[0] - 1, N, packed.shape[1])


@_fake("repack")
def _repack_fake(packed, cu_seqlens, keep, *, fuse_weights=None):
    T, C = packed.shape
    B = cu_seqlens.shape[0] - 1
    T2 = _dynamic_rows(T + (B if fuse_weights is not None else 0))
    return (_new(packed, T2, C), _new(packed, B + 1, dtype=torch.int32),
            _new(packed, T2, dtype=torch.int32))


@_fake("gather_prefix")
def _gather_prefix_fake(packed, cu_seqlens, k):
    return _new(packed, cu_seqlens.shape[0] - 1, k, packed.shape[1])


@_fake("segment_mean")
def _segment_mean_fake(packed, cu_seqlens, *, skip=0):
    return _new(packed, cu_seqlens.shape[0] - 1, packed.shape[1])


@_fake("linear")
def _linear_fake(x, weight, bias=None, *, residual=None):
    return _new(x, x.shape[0], weight.shape[0])


@_fake("layer_norm")
def _layer_norm_fake(x, weight=None, bias=None, *, eps=1e-5):
    return _new(x, *x.shape)


@_fake("gelu")
def _gelu_fake(x):
    return _new(x, *x.shape)


@_fake("topk_index")
def _topk_index_fake(scores, k, *, prefix=0):
    return _new(scores, scores.shape[0], prefix + k, dtype=torch.int64)


@_fake("uniform_cu_seqlens")
def _uniform_cu_seqlens_fake(num_seqs, seq_len, device):
    return torch.empty(num_seqs + 1, dtype=torch.int32, device=device)


def _nothing(*args, **kwargs):
    return None


for _name in ("pack_into", "repack_into"):
    _fake(_name)(_nothing)
for _name in OPS:
    if "{out}" in _SCHEMAS[_name]:
        _fake(f"{_name}.out")(_nothing)
_fake("attention.cls_attn_out")(_nothing)


# ---- the Python ops' signatures over torch.ops.ragvit ----
# `stream=` has no meaning in a traced graph (torch launches on the current stream); passing
# one is refused rather than ignored.


def _no_stream(op: str, stream) -> None:
    if stream is not None:
        raise ValueError(f"ragvit.library.{op}: stream must be None under torch.ops.ragvit "
                         "(ops run on the current stream)")


def attention(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None, out=None, cls_attn=None,
              bias=None, stream=None):
    """ragvit.attention through torch.ops.ragvit.attention (same arguments and result)."""
    _no_stream("attention", stream)
    op = torch.ops.ragvit.attention
    args = (q, k, v, cu_seqlens, max_seqlen)
    if cls_attn is None:
        if out is None:
            return op.default(*args, scale=scale, bias=bias)
        op.out(*args, scale=scale, bias=bias, out=out)
    elif out is None:
        return op.cls_attn(*args, scale=scale, bias=bias, cls_attn=cls_attn)
    else:
        op.cls_attn_out(*args, scale=scale, bias=bias, cls_attn=cls_attn, out=out)
    return out


def pack(x, keep, *, stream=None):
    """ragvit.pack through torch.ops.ragvit.pack (a data-dependent row count)."""
    _no_stream("pack", stream)
    return torch.ops.ragvit.pack.default(x, keep)


def pack_into(x, keep, out, cu_seqlens, *, indices=None, stream=None):
    """ragvit.pack_into through torch.ops.ragvit.pack_into (capacity buffers, no sync)."""
    _no_stream("pack_into", stream)
    torch.ops.ragvit.pack_into.default(x, keep, out, cu_seqlens, indices=indices)


def _functional_or_out(name: str, stream, out, *args, **kwargs):
    """torch.ops.ragvit.<name>'s functional overload when out is None, else its .out overload
    writing out (returned), after refusing a stream."""
    _no_stream(name, stream)
    op = getattr(torch.ops.ragvit, name)
    if out is None:
        return op.default(*args, **kwargs)
    op.out(*args, **kwargs, out=out)
    return out


def unpack(packed, cu_seqlens, N, *, indices=None, fill=0.0, out=None, stream=None):
    """ragvit.unpack through torch.ops.ragvit.unpack."""
    return _functional_or_out("unpack", stream, out, packed, cu_seqlens, N, indices=indices,
                              fill=fill)


def repack(packed, cu_seqlens, keep, *, fuse_weights=None, stream=None):
    """ragvit.repack through torch.ops.ragvit.repack (a data-dependent row count)."""
    _no_stream("repack", stream)
    return torch.ops.ragvit.repack.default(packed, cu_seqlens, keep, fuse_weights=fuse_weights)


def repack_into(packed, cu_seqlens, keep, out, cu_seqlens_out, *, src=None, fuse_weights=None,
                stream=None):
    """ragvit.repack_into through torch.ops.ragvit.repack_into (capacity buffers, no sync)."""
    _no_stream("repack_into", stream)
    torch.ops.ragvit.repack_into.default(packed, cu_seqlens, keep, out, cu_seqlens_out,
                                         src=src, fuse_weights=fuse_weights)


def gather_prefix(packed, cu_seqlens, k, *, out=None, stream=None):
    """ragvit.gather_prefix through torch.ops.ragvit.gather_prefix."""
    return _functional_or_out("gather_prefix", stream, out, packed, cu_seqlens, k)


def segment_mean(packed, cu_seqlens, *, skip=0, out=None, stream=None):
    """ragvit.segment_mean through torch.ops.ragvit.segment_mean."""
    return _functional_or_out("segment_mean", stream, out, packed, cu_seqlens, skip=skip)


def linear(x, weight, bias=None, *, residual=None, out=None, stream=None):
    """ragvit.linear through torch.ops.ragvit.linear (out may be residual: in place)."""
    return _functional_or_out("linear", stream, out, x, weight, bias, residual=residual)


def layer_norm(x, weight=None, bias=None, *, eps=1e-5, out=None, stream=None):
    """ragvit.layer_norm through torch.ops.ragvit.layer_norm (out may be x)."""
    return _functional_or_out("layer_norm", stream, out, x, weight, bias, eps=eps)


def gelu(x, *, out=None, stream=None):
    """ragvit.gelu through torch.ops.ragvit.gelu (out may be x)."""
    return _functional_or_out("gelu", stream, out, x)


def topk_index(scores, k, *, prefix=0, out=None, stream=None):
    """ragvit.topk_index through torch.ops.ragvit.topk_index."""
    return _functional_or_out("topk_index", stream, out, scores, k, prefix=prefix)


def uniform_cu_seqlens(num_seqs, seq_len, device) -> torch.Tensor:
    """cu_seqlens (int32, num_seqs + 1) of num_seqs sequences of seq_len tokens each, on
    device, through torch.ops.ragvit.uniform_cu_seqlens: what a traced forward feeds its ops.

    Inductor computes a tensor that reads no memory (arange times a constant) afresh for each
    op that consumes it, one kernel per call (ragvit's ops take their inputs at exact
    strides); an op's output is one buffer that every consumer shares.
    """
    return torch.ops.ragvit.uniform_cu_seqlens.default(num_seqs, seq_len, device)


# ---- tracing: Dynamo polyfills and the non-strict export swap ----

_ROUTED = {name: globals()[name] for name in OPS}

for _name, _fn in _ROUTED.items():
    torch.compiler.substitute_in_graph(getattr(_C, _name), skip_signature_check=True)(_fn)

_ROUTE_LOCK = threading.Lock()


@contextlib.contextmanager
def routed_ops():
    """Within the block, ragvit.<op> and ragvit.ops.<op> are this module's functions.

    For tracing that runs no Dynamo (non-strict torch.export), where a C entry point would
    receive fake tensors: code that looks its ops up as `ragvit.ops.<op>` or `ragvit.<op>`
    at call time (ragvit's patched forward and its policies) then records torch.ops.ragvit
    calls. Process-wide for the block; blocks in several threads are serialised.
    """
    import ragvit

    from . import ops

    with _ROUTE_LOCK:
        saved = [(mod, name, getattr(mod, name)) for mod in (ops, ragvit) for name in OPS]
        try:
            for mod, name, _ in saved:
                setattr(mod, name, _ROUTED[name])
            yield
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)
