"""Token-pruning policies for ragvit.patch: score tokens, choose which ones to keep.

A policy sees a `TokenBatch` (the packed `(T, C)` rows of a batch at one pruning point,
their `cu_seqlens`, and on request the head-mean CLS attention, value norms and keys of an
attention call) and returns a `Selection`: per-image keep indices (fixed counts,
sync-free, capturable in a CUDA graph exactly), optionally with a merge map (ToMe), or a
`(T,)` keep mask over the packed rows (counts that depend on the data); either may carry
fusion weights (the dropped rows of every image averaged into one appended token, EViT).
Policies own no kernels: they use small device-side torch ops and never read device
memory on the host, so the patched forward stays sync-free. The same policy object drives
the packed pipeline (`ragvit.patch`) and the padded-masked reference
(`ragvit.reference.vit_forward_reference`), so both make the same decisions.

Pruning points `layers=(i, ...)`:
    block input (default; ThresholdL2, DynamicViT): tokens are pruned at the input of
        block i (after i blocks have run); `cls_attn` / `value_norm` / `keys` then come
        from block i-1's attention call.
    mid block (`prune_mid_block = True`; EViT, ATS, ToMe): tokens are pruned inside
        block i, after its attention residual and before its MLP; `cls_attn` /
        `value_norm` / `keys` come from block i's own attention call (no extra pass).

| policy | scores | counts |
| --- | --- | --- |
| `ThresholdL2` | token L2 norm | fixed (keep=) or ragged (threshold=) |
| `EViT` | head-mean CLS attention; dropped tokens fused | fixed |
| `ATS` | CLS attention x value norm, inverse-transform sampling | ragged |
| `ToMe` | bipartite matching of head-mean keys; merges, log(size) bias | fixed |
| `DynamicViT` | learned per-stage prediction MLPs | fixed |

Fixed counts run sync-free; ragged ones read the new total once per stage in an eager
forward, or none with `ragvit.patch(..., capacity=True)`.

Writing your own policy
-----------------------
Subclass `PruningPolicy`, set `layers` and the class flags, implement `select`::

    class ClsTopK(PruningPolicy):
        # Keeps the ceil(keep * n) patch tokens the CLS token attends to most.
        needs_cls_attn = True      # batch.cls_attn: (T,) float32
        prune_mid_block = False    # prune at block inputs
        is_fixed = True            # same count for every image -> sync-free

        def __init__(self, keep, layers):
            self.keep, self.layers = keep, tuple(layers)

        def select(self, batch):
            return topk_selection(batch, batch.cls_attn, self.keep)

Rules that keep the two pipelines equal and the forward sync-free:
    * compute only from `batch` (rows, cu_seqlens, seq_ids, positions, is_patch, cls_attn,
      value_norm, keys, sizes, num_tokens) with device-side torch ops; no `.item()`,
      `.tolist()`, `nonzero` or boolean-mask indexing (they sync the host);
    * treat rows past `cu_seqlens[B]` as garbage (`batch.is_patch` is False there) and
      break ties by position (stable sorts), so the packed and padded runs agree;
    * return `Selection(index=...)` only when `batch.seq_len` is known and every image
      keeps the same count (set `is_fixed = True`): int64 positions, the prefix 0..P-1
      first, then ascending (any order without repeats with `assign=`); otherwise
      `Selection(keep=...)`, whose prefix rows are kept whatever it says, with a host
      bound `max_seqlen` if you know one (capacity mode sizes buffers with it);
    * `fuse_weights=` (T,) float32 appends one token per image: the weighted mean of its
      dropped rows (EViT); `assign=` merges tokens instead of dropping them (ToMe);
    * a Selection's types and shapes are checked at every pruning point, its contents
      (the index rules, `max_seqlen` against the kept counts) on CPU rows and in debug
      mode (`ragvit.set_debug(True)`: a host read per pruning point): on CUDA outside
      debug mode an index out of its image fails in torch's gather, and an understated
      `max_seqlen` gives attention too short a bound (wrong rows);
    * `check(depth)` validates `layers`; override it to validate more, calling super;
    * test it like tests/test_policies.py does: `check_against_reference` (patched vs
      reference logits and decisions) plus a float64 re-implementation of the scores.
Helpers: `topk_selection` (per-image top-k in both forms), `segment_mean_scores`,
`patch_means`, `kept_count`.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from . import ops

__all__ = [
    "ATS",
    "DynamicViT",
    "EViT",
    "PruningPolicy",
    "Selection",
    "ThresholdL2",
    "ToMe",
    "TokenBatch",
]


@dataclass
class TokenBatch:
    """The tokens of a batch at one pruning point, packed.

    Attributes:
        rows: (T, C) packed tokens, image after image; rows past cu_seqlens[B] (capacity
            mode) hold garbage and belong to no image.
        cu_seqlens: (B+1,) int32 on rows' device, exclusive prefix sums of the lengths.
        num_prefix: P, leading prefix tokens of every image (CLS, distillation, registers);
            always kept, whatever a policy returns.
        seq_len: the length L shared by every image when it is known on the host (T = B*L,
            so rows.view(B, L, C) is valid), else None (ragged).
        max_seqlen: host upper bound on every length.
        layer: the pruning point (index of the block about to run).
        num_tokens: N, tokens per image when embedded (prefix included), before any
            pruning (DynamicViT keeps fractions of the initial patch count).
        stage: 0 for the policy's first pruning point, 1 for the second, ...
        cls_attn: (T,) float32 head-mean softmax attention of each image's first token
            over its keys in the feeding attention call (the previous block's, or this
            block's for mid-block points), when the policy asked for it.
        value_norm: (T,) float32 head-mean L2 norm of each row's value vectors in the same
            attention call, when the policy asked for it (`needs_value_norm`).
        keys: (T, D) float32 head-mean key vectors of the same attention call, when the
            policy asked for them (`needs_keys`; ToMe's similarity metric).
        sizes: (T,) float32 number of embedded tokens each row stands for, once a merging
            policy has merged rows (None: every row is one token).
    """

    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    num_prefix: int
    seq_len: int | None
    max_seqlen: int
    layer: int
    stage: int
    cls_attn: torch.Tensor | None = None
    num_tokens: int | None = None
    value_norm: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    sizes: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        """B, the number of images."""
        return self.cu_seqlens.shape[0] - 1

    @property
    def total_tokens(self) -> int:
        """T, the number of packed rows (a capacity in capacity mode)."""
        return self.rows.shape[0]

    @cached_property
    def seq_ids(self) -> torch.Tensor:
        """(T,) int64 image of each row; B for rows past cu_seqlens[B]."""
        ar = torch.arange(self.total_tokens, device=self.rows.device)
        if self.seq_len is not None:
            return ar // self.seq_len
        return torch.searchsorted(self.cu_seqlens[1:].long(), ar, right=True)

    @cached_property
    def positions(self) -> torch.Tensor:
        """(T,) int64 position of each row within its image."""
        ar = torch.arange(self.total_tokens, device=self.rows.device)
        if self.seq_len is not None:
            return ar % self.seq_len
        return ar - self.cu_seqlens.long()[self.seq_ids]

    @cached_property
    def lengths(self) -> torch.Tensor:
        """(B,) int64 tokens per image (prefix included), on the device."""
        cu = self.cu_seqlens.long()
        return cu[1:] - cu[:-1]

    @cached_property
    def is_patch(self) -> torch.Tensor:
        """(T,) bool: the row is a patch token of some image (not prefix, not garbage)."""
        return (self.positions >= self.num_prefix) & (self.seq_ids < self.num_seqs)


@dataclass
class Selection:
    """What a policy keeps. Exactly one of `index` and `keep` is set.

    Attributes:
        index: (B, k) int64 positions within each image, the prefix positions 0..P-1
            first, then ascending (with assign: in any order, without repeats); only when
            the batch's seq_len is known. Every image keeps k tokens: sync-free and exact
            under CUDA-graph capture.
        keep: (T,) bool over the packed rows (prefix rows are kept regardless); counts
            depend on the data (an eager forward reads the new total once; capacity mode
            does not).
        max_seqlen: optional host upper bound (an int >= P) on the kept length of every
            image, prefix included, a fused token not.
        fuse_weights: optional (T,) float32: every image gets one extra token after its
            kept ones, sum(w x) / sum(w) over its dropped rows in float32, for weights of
            any sign (zeros when sum(w) == 0, e.g. nothing dropped): EViT's
            inattentive-token fusion. The count of every image grows by exactly 1 (still
            fixed for an index Selection).
        assign: optional (B, L) int64 with an index Selection (token merging, ToMe): the
            output slot in [0, k) of every token; slot j becomes the size-weighted mean of
            the tokens assigned to it and its size their total (index[:, j] names the
            token that represents it). Later attention calls add log(size) to every key's
            logits (proportional attention, through ragvit.attention's bias).
    """

    index: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    max_seqlen: int | None = None
    fuse_weights: torch.Tensor | None = None
    assign: torch.Tensor | None = None

    def __post_init__(self):
        if (self.index is None) == (self.keep is None):
            raise ValueError("Selection: exactly one of index and keep must be given")
        if self.assign is not None and self.index is None:
            raise ValueError("Selection: assign needs an index Selection")


def _check_selection(sel, batch: TokenBatch, policy: str, values: bool) -> None:
    """Raises TypeError / ValueError (naming `policy`.select) unless sel is a Selection that
    fits batch: types, shapes and devices always (host metadata); with values, also the
    contents (index positions in range, the prefix first, ascending or, with assign, unique;
    assign slots in range with index[:, j] in slot j), which costs a host read of the device
    (the patched forward asks for it on CPU rows and in ragvit's debug mode)."""
    name = f"{policy}.select"
    if not isinstance(sel, Selection):
        raise TypeError(f"{name} must return a Selection, got {type(sel).__name__}")
    B, T, P, L = batch.num_seqs, batch.total_tokens, batch.num_prefix, batch.seq_len
    device = batch.rows.device

    def described(t) -> str:
        if isinstance(t, torch.Tensor):
            return f"{tuple(t.shape)} {t.dtype} on {t.device}"
        return type(t).__name__

    def tensor_check(t, what: str, shape: tuple, dtype: torch.dtype | None):
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.device == device
                and (t.dtype == dtype if dtype is not None else t.dtype.is_floating_point)):
            kind = str(dtype).removeprefix("torch.") if dtype is not None else "floating"
            article = "an" if kind[0] in "aeiou" else "a"
            raise ValueError(f"{name}: {what} must be {article} {kind} tensor of shape "
                             f"{shape} on {device}, got {described(t)}")

    if sel.max_seqlen is not None and (isinstance(sel.max_seqlen, bool) or not isinstance(
            sel.max_seqlen, numbers.Integral) or sel.max_seqlen < P):
        raise ValueError(f"{name}: max_seqlen must be None or an int >= num_prefix ({P}), "
                         f"got {sel.max_seqlen!r}")
    if sel.fuse_weights is not None:
        tensor_check(sel.fuse_weights, "fuse_weights", (T,), None)
    if sel.keep is not None:
        tensor_check(sel.keep, "keep", (T,), torch.bool)
        return
    if L is None:
        raise ValueError(f"{name}: an index Selection needs a batch with seq_len known")
    index = sel.index
    if not (isinstance(index, torch.Tensor) and index.ndim == 2 and index.shape[0] == B
            and P <= index.shape[1] <= L and index.dtype == torch.int64
            and index.device == device):
        raise ValueError(f"{name}: index must be an int64 tensor of shape (B, k) on {device} "
                         f"with B = {B} and {P} <= k <= {L}, got {described(index)}")
    k = index.shape[1]
    if sel.assign is not None:
        tensor_check(sel.assign, "assign", (B, L), torch.int64)
    if not values or B == 0:
        return
    if not bool((index[:, :P] == torch.arange(P, device=device)).all()):
        raise ValueError(f"{name}: index must start with the prefix positions 0..{P - 1} in "
                         "every image")
    if not bool(((index >= 0) & (index < L)).all()):
        raise ValueError(f"{name}: index positions must lie in [0, {L})")
    rising = torch.sort(index, dim=1).values if sel.assign is not None else index
    if not bool((rising[:, 1:] > rising[:, :-1]).all()):
        rule = "unique" if sel.assign is not None else "strictly ascending"
        raise ValueError(f"{name}: index positions must be {rule} in every image")
    if sel.assign is not None:
        assign = sel.assign
        if not bool(((assign >= 0) & (assign < k)).all()) or not bool(
                (assign.gather(1, index) == torch.arange(k, device=device)).all()):
            raise ValueError(f"{name}: assign must map every token to a slot in [0, {k}), "
                             "the token index[:, j] to slot j")


def _check_max_seqlen(sel: Selection, kept: list[int], policy: str) -> None:
    """ValueError unless sel.max_seqlen (if given) bounds kept, every image's kept count
    (prefix included, a fused token not)."""
    if sel.max_seqlen is None:
        return
    for b, n in enumerate(kept):
        if n > sel.max_seqlen:
            raise ValueError(f"{policy}.select: max_seqlen={sel.max_seqlen} is below the {n} "
                             f"tokens image {b} keeps")


class PruningPolicy:
    """Base class of pruning policies.

    Subclasses set `layers` (ascending block indices, see the module docs), set
    `needs_cls_attn` / `needs_value_norm` when `select` reads `batch.cls_attn` /
    `batch.value_norm`, set `prune_mid_block` to prune between a block's attention and
    its MLP, set `is_fixed` to False when per-image counts depend on token values, and
    implement `select`.
    """

    layers: tuple[int, ...] = ()
    needs_cls_attn: bool = False
    needs_value_norm: bool = False
    needs_keys: bool = False
    prune_mid_block: bool = False
    is_fixed: bool = True

    def select(self, batch: TokenBatch) -> Selection:
        """Chooses the tokens to keep at one pruning point.

        Args:
            batch: the packed tokens at `batch.layer` (see TokenBatch).

        Returns:
            A Selection; prefix tokens are always kept.
        """
        raise NotImplementedError

    def check(self, depth: int) -> None:
        """Raises ValueError unless the pruning points fit a model with `depth` blocks
        (TypeError unless `layers` is a sequence of ints)."""
        layers = _layers(type(self).__name__, self.layers)
        if not layers:
            raise ValueError(f"{type(self).__name__}: layers must not be empty")
        if list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= depth:
            raise ValueError(
                f"{type(self).__name__}: layers must be ascending block indices in "
                f"[0, {depth}), got {layers}"
            )
        needs = self.needs_cls_attn or self.needs_value_norm or self.needs_keys
        if needs and not self.prune_mid_block and layers[0] == 0:
            raise ValueError(f"{type(self).__name__}: layer 0 has no previous attention for "
                             "cls_attn / value_norm / keys")


def _check_ratio(name: str, keep_ratio) -> None:
    if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, numbers.Real):
        raise TypeError(f"{name}: keep_ratio must be a number in (0, 1], got {keep_ratio!r}")
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"{name}: keep_ratio must be in (0, 1], got {keep_ratio}")


def kept_count(keep_ratio: float, num_patches: int) -> int:
    """Patch tokens kept out of num_patches: ceil(keep_ratio * n), at least 1 (0 if n == 0).

    Raises:
        ValueError: keep_ratio is not in (0, 1] (TypeError: not a number).
    """
    _check_ratio("kept_count", keep_ratio)
    if num_patches <= 0:
        return 0
    return max(1, math.ceil(keep_ratio * num_patches - 1e-6))


def topk_selection(batch: TokenBatch, scores: torch.Tensor, keep_ratio: float) -> Selection:
    """Keeps the prefix and the top ceil(keep_ratio * n) patch tokens of every image.

    Args:
        batch: the tokens (n = an image's patch-token count).
        scores: (T,) float scores, higher is kept first; ties keep the earlier token.
        keep_ratio: fraction in (0, 1].

    Returns:
        An index Selection when batch.seq_len is known (same k for every image), else a
        keep mask ranked per image with device ops only.

    Raises:
        ValueError: keep_ratio is not in (0, 1] (TypeError: not a number), or scores is
            not a (T,) tensor on the rows' device.
    """
    _check_ratio("topk_selection", keep_ratio)
    if not (isinstance(scores, torch.Tensor) and tuple(scores.shape) == (batch.total_tokens,)
            and scores.device == batch.rows.device):
        got = (f"{tuple(scores.shape)} on {scores.device}" if isinstance(scores, torch.Tensor)
               else type(scores).__name__)
        raise ValueError(f"topk_selection: scores must be a ({batch.total_tokens},) tensor on "
                         f"{batch.rows.device}, got {got}")
    P = batch.num_prefix
    if batch.seq_len is not None:
        B, L = batch.num_seqs, batch.seq_len
        k = kept_count(keep_ratio, L - P)
        if L <= ops.TOPK_INDEX_MAX_COLS:  # one launch instead of topk + sort + arange + cat
            # detached: indices carry no gradient, and ragvit's ops refuse what needs one
            return Selection(index=ops.topk_index(scores.detach().reshape(B, L).contiguous(),
                                                  k, prefix=P))
        top = torch.topk(scores.view(B, L)[:, P:].float(), k, dim=1, sorted=False).indices
        top = torch.sort(top, dim=1).values + P
        prefix = torch.arange(P, device=top.device).expand(B, P)
        return Selection(index=torch.cat([prefix, top], dim=1))
    seq = batch.seq_ids
    # Rank rows within their image by score (prefix first): sort by score, then stably
    # by image, so rows of image b occupy [cu[b], cu[b+1]) in descending-score order.
    key = torch.where(batch.is_patch, scores.float(), torch.full_like(scores, math.inf,
                                                                    dtype=torch.float32))
    order = torch.sort(key, descending=True, stable=True).indices
    order = order[torch.sort(seq[order], stable=True).indices]
    cu = batch.cu_seqlens.long()
    rank_sorted = torch.arange(batch.total_tokens, device=seq.device) - cu[seq[order]]
    rank = torch.empty_like(rank_sorted).index_copy_(0, order, rank_sorted)
    n_patch = (batch.lengths - P).clamp(min=0)
    counts = torch.ceil(n_patch.double() * keep_ratio - 1e-6).long()
    counts = torch.where(n_patch > 0, counts.clamp(min=1), counts)
    limit = torch.cat([counts + P, counts.new_zeros(1)])  # garbage rows: image B keeps 0
    return Selection(keep=rank < limit[seq], max_seqlen=batch.max_seqlen)


def segment_mean_scores(batch: TokenBatch, scores: torch.Tensor) -> torch.Tensor:
    """(B+1,) float32 mean of `scores` over each image's patch tokens (slot B, for rows past
    cu_seqlens[B]: 0; an image without patch tokens: 0).

    Summed in a fixed order by ragvit.segment_mean, so one input always gives the same
    means: a CUDA index_add_ sums by atomics in any order, and a threshold at a multiple of
    the mean then flipped tokens near it between two forwards of the same images (scores
    that autograd follows take torch's differentiable sum instead, see `patch_means`).
    """
    means = patch_means(batch, scores.float().reshape(-1, 1))
    return torch.cat([means[:, 0], means.new_zeros(1)])


def patch_means(batch: TokenBatch, values: torch.Tensor) -> torch.Tensor:
    """(B, C) mean of `values` (T, C) over each image's rows past its prefix (rows past
    cu_seqlens[B] ignored; an image without such rows: zeros), summed in float32 and
    rounded once to values' dtype.

    Through ragvit.segment_mean, whose fixed summation order gives one input the same means
    every time; when autograd must follow the result (grad mode on and values requiring
    grad, e.g. while training DynamicViT's predictors) through torch's index_add instead,
    which carries the gradient (ragvit's ops have no backward).
    """
    if not (torch.is_grad_enabled() and values.requires_grad):
        return ops.segment_mean(values, batch.cu_seqlens, skip=batch.num_prefix)
    B, seq = batch.num_seqs, batch.seq_ids
    weight = batch.is_patch.float()
    sums = torch.zeros(B + 1, values.shape[1], device=values.device).index_add(
        0, seq, values.float() * weight[:, None])
    counts = torch.zeros(B + 1, device=values.device).index_add(0, seq, weight)
    return (sums[:B] / counts[:B].clamp(min=1)[:, None]).to(values.dtype)


class ThresholdL2(PruningPolicy):
    """Prunes patch tokens with small L2 norm (score = ||token||_2).

    Two modes:
        keep=r (fixed counts): every image keeps ceil(r * n) of its n patch tokens (top
            scores), so counts are known on the host: sync-free, capturable.
        threshold=t (ragged counts): an image keeps the patch tokens whose norm is at least
            t times the mean patch-token norm of that image, plus its highest-norm token;
            counts differ per image.

    The paper's configuration is ThresholdL2(keep=0.5, layers=(4,)): keep 50% of the
    patch tokens after block 4 (at the input of block index 4).

    Args:
        keep: fraction in (0, 1], or one fraction per pruning point.
        threshold: positive factor on the per-image mean norm, or one per pruning point.
        layers: pruning points (block indices, ascending).

    Raises:
        ValueError: not exactly one of keep/threshold, a value out of range (NaN
            included), or a per-stage sequence whose length differs from layers.
        TypeError: layers is not a sequence of ints, or a value is not a number.
    """

    def __init__(
        self,
        keep: float | Sequence[float] | None = None,
        *,
        threshold: float | Sequence[float] | None = None,
        layers: Sequence[int] = (4,),
    ):
        if (keep is None) == (threshold is None):
            raise ValueError("ThresholdL2: exactly one of keep and threshold must be given")
        self.layers = _layers("ThresholdL2", layers)
        if keep is not None:
            values = _per_stage("ThresholdL2", "keep", keep, self.layers, _real,
                                "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        else:
            values = _per_stage("ThresholdL2", "threshold", threshold, self.layers, _real,
                                "finite and > 0", lambda v: 0.0 < v < math.inf)
        self.keep = values if keep is not None else None
        self.threshold = values if threshold is not None else None
        self.is_fixed = keep is not None

    def __repr__(self) -> str:
        mode = f"keep={self.keep}" if self.keep is not None else f"threshold={self.threshold}"
        return f"ThresholdL2({mode}, layers={self.layers})"

    def select(self, batch: TokenBatch) -> Selection:
        scores = torch.linalg.vector_norm(batch.rows, dim=-1, dtype=torch.float32)  # one kernel
        if self.keep is not None:
            return topk_selection(batch, scores, self.keep[batch.stage])
        seq = batch.seq_ids
        mean = segment_mean_scores(batch, scores)
        masked = torch.where(batch.is_patch, scores, torch.full_like(scores, -math.inf))
        best = torch.full((batch.num_seqs + 1,), -math.inf, device=scores.device)
        best = best.scatter_reduce(0, seq, masked, reduce="amax")
        keep = batch.is_patch & ((scores >= self.threshold[batch.stage] * mean[seq])
                                 | (masked >= best[seq]))
        return Selection(keep=keep, max_seqlen=batch.max_seqlen)


def _per_stage(policy: str, arg: str, value, layers: tuple[int, ...], cast, rule: str,
               ok) -> tuple:
    """One value per pruning point from a scalar or a sequence, validated: cast(policy, arg,
    v) converts each value (TypeError for a wrong type), ok(v) is the rule it must meet
    (ValueError "<policy>: <arg> must be <rule>, got v")."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        values = tuple(cast(policy, arg, v) for v in value)
    else:
        values = (cast(policy, arg, value),) * len(layers)
    if len(values) != len(layers):
        raise ValueError(f"{policy}: one value per layer needed, got {len(values)} {arg} "
                         f"values for layers {layers}")
    for v in values:
        if not ok(v):
            raise ValueError(f"{policy}: {arg} must be {rule}, got {v}")
    return values


def _real(policy: str, arg: str, v) -> float:
    """v as a float: any real number but a bool (NaN passes, for the rule to refuse)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{policy}: {arg} must be a number or one number per layer, got "
                        f"{v!r}")
    return float(v)


def _integer(policy: str, arg: str, v) -> int | float:
    """v as an int when it is an integral number (8 or 8.0; not a bool); another number
    (2.5, NaN) comes back as a float, for the rule (an int test) to refuse; TypeError for
    anything else."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{policy}: {arg} must be an int or one int per layer, got {v!r}")
    if isinstance(v, numbers.Integral) or (math.isfinite(v) and int(v) == v):
        return int(v)
    return float(v)


def _layers(policy: str, layers) -> tuple[int, ...]:
    """layers as a tuple of ints: a sequence (not a string) of integers (not bools)."""
    if isinstance(layers, str | bytes) or not isinstance(layers, Sequence) or any(
            isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in layers):
        raise TypeError(f"{policy}: layers must be a sequence of ints, got {layers!r}")
    return tuple(int(i) for i in layers)


def _cls_attn(batch: TokenBatch, name: str) -> torch.Tensor:
    if batch.cls_attn is None:
        raise ValueError(f"{name}.select: batch.cls_attn must be given (needs_cls_attn)")
    return batch.cls_attn


class EViT(PruningPolicy):
    """EViT (Liang et al., ICLR 2022): keep the patch tokens the CLS token attends to most.

    Inside each block of `layers`, after its attention residual and before its MLP, every
    image keeps its top ceil(keep_rate * n) patch tokens by head-mean CLS attention of
    that block's own attention call (the kernel's `cls_attn` output; prefix tokens always
    kept; a fused token of an earlier stage counts as a patch token). With `fuse=True`
    the dropped tokens are averaged into one token appended per image, weighted by their
    CLS attention: sum(a x) / sum(a) (the EViT code uses the unnormalised sum(a x); the
    weighted mean is what ragvit.repack computes and keeps the fused token on the scale
    of the others). Counts are fixed: sync-free and CUDA-graph capturable.

    Args:
        keep_rate: fraction in (0, 1], or one per pruning point (EViT, DeiT-S: 0.7).
        layers: block indices, ascending (EViT, DeiT-S: (3, 6, 9)).
        fuse: fuse the dropped tokens into one (True) or drop them (False).

    Raises:
        ValueError: keep_rate out of (0, 1] or one per layer of the wrong length.
        TypeError: layers is not a sequence of ints, keep_rate not a number, or fuse not
            a bool.
    """

    needs_cls_attn = True
    prune_mid_block = True
    is_fixed = True

    def __init__(self, keep_rate: float | Sequence[float] = 0.7,
                 layers: Sequence[int] = (3, 6, 9), *, fuse: bool = True):
        self.layers = _layers("EViT", layers)
        self.keep_rate = _per_stage("EViT", "keep_rate", keep_rate, self.layers, _real,
                                    "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        if not isinstance(fuse, bool):
            raise TypeError(f"EViT: fuse must be True or False, got {fuse!r}")
        self.fuse = fuse

    def __repr__(self) -> str:
        return f"EViT(keep_rate={self.keep_rate}, layers={self.layers}, fuse={self.fuse})"

    def select(self, batch: TokenBatch) -> Selection:
        scores = _cls_attn(batch, "EViT")
        keep_rate = self.keep_rate[batch.stage]
        sel = topk_selection(batch, scores, keep_rate)
        if self.fuse and keep_rate < 1.0:
            sel.fuse_weights = torch.where(batch.is_patch, scores.float(),
                                           torch.zeros((), device=scores.device))
        return sel


def ats_significance(batch: TokenBatch) -> torch.Tensor:
    """(T,) float64 ATS significance: cls_attn * value_norm over each image's patch tokens,
    normalised to sum 1 per image (uniform when an image's total is 0; 0 off patches)."""
    sig = _cls_attn(batch, "ATS").double() * batch.value_norm.double()
    is_patch = batch.is_patch
    sig = torch.where(is_patch, sig, torch.zeros((), dtype=sig.dtype, device=sig.device))
    seq = batch.seq_ids
    zeros = torch.zeros(batch.num_seqs + 1, dtype=torch.float64, device=sig.device)
    total = zeros.index_add(0, seq, sig)[seq]
    count = zeros.index_add(0, seq, is_patch.double())[seq]
    uniform = is_patch.double() / count.clamp(min=1)
    return torch.where(total > 0, sig / total.clamp(min=torch.finfo(torch.float64).tiny),
                       uniform)


def ats_sample(batch: TokenBatch, num_samples: int) -> torch.Tensor:
    """(T,) bool ATS keep mask: deterministic inverse-transform sampling of significance.

    Per image, patch tokens are sorted by ascending significance (ties by position), their
    cumulative sum is the CDF, and each of the num_samples quantiles (i + 0.5) / K picks
    the first token whose CDF exceeds it; duplicates collapse, so counts are ragged.
    """
    p = ats_significance(batch)
    seq = batch.seq_ids
    T, B = batch.total_tokens, batch.num_seqs
    order = torch.sort(p, stable=True).indices
    order = order[torch.sort(seq[order], stable=True).indices]  # by image, then by p
    seq_sorted = seq[order]
    csum = torch.cumsum(p[order], 0)
    cu = batch.cu_seqlens.long()
    before = torch.cat([csum.new_zeros(1), csum])[cu]  # (B+1,) mass before each image
    # One monotone key over the batch: image b's CDF lives in [2b, 2b + 1].
    key = 2.0 * seq_sorted.double() + (csum - before[seq_sorted])
    K = num_samples
    quant = (torch.arange(K, dtype=torch.float64, device=p.device) + 0.5) / K
    images = torch.arange(B, device=p.device)
    idx = torch.searchsorted(key, (2.0 * images.double()[:, None] + quant).reshape(-1),
                             right=True).view(B, K)
    first, last = cu[:-1, None], cu[1:, None] - 1
    n_patch = (batch.lengths - batch.num_prefix)[:, None]
    idx = torch.minimum(torch.maximum(idx, first), last.clamp(min=0))
    target = torch.where(n_patch > 0, order[idx.clamp(max=max(T - 1, 0))], T)
    keep = torch.zeros(T + 1, dtype=torch.bool, device=p.device)
    # scatter_, not keep[target] = True: CUDA index_put_ syncs the host
    keep.scatter_(0, target.reshape(-1), True)
    return keep[:T] & batch.is_patch


class ATS(PruningPolicy):
    """ATS, Adaptive Token Sampling (Fayyaz et al., ECCV 2022), parameter-free at inference.

    Inside each block of `layers`, after its attention residual and before its MLP:
    significance S_j = cls_attn_j * ||v_j|| (head-mean CLS attention and head-mean value
    norm of that block's attention call) over the patch tokens, normalised per image;
    `num_samples` evenly spaced quantiles (i + 0.5) / K of its CDF (tokens sorted by
    ascending significance) each pick one token; duplicates collapse. Each image keeps a
    different number of tokens (at most min(K, n) + prefix): counts are data-dependent
    (an eager forward syncs once per stage; use capacity mode to stay sync-free).

    Args:
        num_samples: K, an int >= 1, or one per pruning point.
        layers: block indices, ascending.

    Raises:
        ValueError: num_samples not an int >= 1, or one per layer of the wrong length.
        TypeError: layers is not a sequence of ints, or num_samples not a number.
    """

    needs_cls_attn = True
    needs_value_norm = True
    prune_mid_block = True
    is_fixed = False

    def __init__(self, num_samples: int | Sequence[int] = 108, layers: Sequence[int] = (3,)):
        self.layers = _layers("ATS", layers)
        self.num_samples = _per_stage("ATS", "num_samples", num_samples, self.layers,
                                      _integer, "an int >= 1",
                                      lambda v: isinstance(v, int) and v >= 1)

    def __repr__(self) -> str:
        return f"ATS(num_samples={self.num_samples}, layers={self.layers})"

    def select(self, batch: TokenBatch) -> Selection:
        if batch.value_norm is None:
            raise ValueError("ATS.select: batch.value_norm must be given (needs_value_norm)")
        K = self.num_samples[batch.stage]
        return Selection(keep=ats_sample(batch, K),
                         max_seqlen=min(batch.max_seqlen, batch.num_prefix + K))


def tome_match(batch: TokenBatch, r: int) -> Selection:
    """ToMe's bipartite soft matching on a uniform batch: an index + assign Selection.

    Tokens at even positions form set A, odd positions set B (as in ToMe); prefix tokens
    are never merged nor merged into. Every A patch token's best match in B is its
    highest cosine similarity of head-mean keys; the r A tokens with the most similar
    matches (ties: earlier first) merge into them. Output order: prefix, the unmerged A
    tokens, then every B token, each group by position (ToMe's order for a CLS token).

    Args:
        batch: uniform batch (seq_len known) with keys.
        r: tokens to merge per image; capped at (L - P) // 2.

    Returns:
        Selection(index=(B, L - r), assign=(B, L)).
    """
    B, L, P = batch.num_seqs, batch.seq_len, batch.num_prefix
    dev = batch.rows.device
    r = max(0, min(r, (L - P) // 2))
    metric = batch.keys.float().view(B, L, batch.keys.shape[-1])
    metric = metric / torch.linalg.vector_norm(metric, dim=-1, keepdim=True).clamp(min=1e-12)
    pos = torch.arange(L, device=dev)
    a_pos, b_pos = pos[0::2], pos[1::2]
    scores = metric[:, 0::2] @ metric[:, 1::2].transpose(1, 2)  # (B, |A|, |B|)
    scores = scores.masked_fill((b_pos < P)[None, None, :], -math.inf)
    node_max, node_idx = scores.max(dim=-1)
    node_max = node_max.masked_fill((a_pos < P)[None, :], -math.inf)
    edge = torch.sort(node_max, dim=-1, descending=True, stable=True).indices
    src_a, unm_a = edge[:, :r], torch.sort(edge[:, r:], dim=-1).values
    # Prefix tokens (node_max -inf, never a source) lead unm_a; put all P first.
    n_pre_a, n_pre_b = (P + 1) // 2, P // 2
    index = torch.cat([pos[:P].expand(B, P), a_pos[unm_a[:, n_pre_a:]],
                       b_pos[n_pre_b:].expand(B, -1)], dim=1)
    k = L - r
    slot = torch.empty(B, L, dtype=torch.long, device=dev)
    slot.scatter_(1, index, torch.arange(k, device=dev).expand(B, k))
    src_pos, dst_pos = a_pos[src_a], b_pos[node_idx.gather(1, src_a)]
    assign = slot.scatter(1, src_pos, slot.gather(1, dst_pos))
    return Selection(index=index, assign=assign)


class ToMe(PruningPolicy):
    """ToMe, Token Merging (Bolya et al., ICLR 2023), training-free at inference.

    Inside each block of `layers`, after its attention residual and before its MLP, every
    image merges r tokens by bipartite soft matching on the head-mean keys of that block's
    attention call (see `tome_match`); merged tokens are size-weighted means, sizes are
    tracked across blocks, and every later attention call adds log(size) to the keys'
    logits (proportional attention, ragvit.attention's bias=). Prefix tokens are never
    merged. Counts are fixed (L - r per block): sync-free and CUDA-graph capturable.
    Unlike ToMe's code, merging runs in float32 whatever the model dtype.

    Args:
        r: tokens merged per image at each pruning point, an int >= 0, or one per layer
            (with layers=None, one per block).
        layers: block indices, ascending; None: every block of the first model that
            checks the policy (`ragvit.patch` or `vit_forward_reference`); a model of
            another depth then needs its own ToMe.

    Raises:
        ValueError: r not an int >= 0, or one per layer of the wrong length.
        TypeError: layers is not a sequence of ints or None, or r not a number.
    """

    needs_keys = True
    prune_mid_block = True
    is_fixed = True

    def __init__(self, r: int | Sequence[int] = 8, layers: Sequence[int] | None = None):
        self._every_block = layers is None
        self._depth = None  # the model depth `check` resolved layers=None for
        self.layers = () if layers is None else _layers("ToMe", layers)
        if self._every_block:  # validated now, one per block checked against the depth
            per_block = isinstance(r, Sequence) and not isinstance(r, str | bytes)
            values = self._values(r, tuple(range(len(r))) if per_block else (0,))
            self._r = values if per_block else values[0]
            self.r = ()
        else:
            self._r = self.r = self._values(r, self.layers)

    @staticmethod
    def _values(r, layers: tuple[int, ...]) -> tuple[int, ...]:
        return _per_stage("ToMe", "r", r, layers, _integer, "an int >= 0",
                          lambda v: isinstance(v, int) and v >= 0)

    def __repr__(self) -> str:
        return f"ToMe(r={self.r}, layers={self.layers})"

    def check(self, depth: int) -> None:
        """As PruningPolicy.check; with layers=None, first resolves them to every block of a
        `depth`-block model (ValueError for a model of another depth than the one an
        earlier check resolved them for, or for one r per block of another length)."""
        if self._every_block:
            if self._depth is not None and self._depth != depth:
                raise ValueError(f"ToMe: layers=None is resolved to every block of a "
                                 f"{self._depth}-block model; a {depth}-block model needs its "
                                 f"own ToMe (or pass layers=)")
            if isinstance(self._r, tuple) and len(self._r) != depth:
                raise ValueError(f"ToMe: one value per layer needed, got {len(self._r)} r "
                                 f"values for the {depth} blocks of layers=None")
            self.layers = tuple(range(depth))
            self.r = self._values(self._r, self.layers)
            self._depth = depth
        super().check(depth)

    def select(self, batch: TokenBatch) -> Selection:
        if batch.keys is None:
            raise ValueError("ToMe.select: batch.keys must be given (needs_keys)")
        if batch.seq_len is None:
            raise ValueError("ToMe.select: batch must be uniform (seq_len known); ToMe's "
                             "counts are fixed")
        return tome_match(batch, self.r[batch.stage])


class DynamicViTPredictor(torch.nn.Module):
    """DynamicViT's prediction module (PredictorLG): local + global features -> keep logit.

    in_conv = LayerNorm, Linear(C, C), GELU; the first C/2 channels are the token's local
    feature, the mean of the last C/2 over the image's patch tokens its global feature;
    out_conv = Linear(C, C/2), GELU, Linear(C/2, C/4), GELU, Linear(C/4, 2), LogSoftmax.
    Attribute names match the DynamicViT checkpoints (`score_predictor.{i}.*`).
    """

    def __init__(self, embed_dim: int):
        super().__init__()
        C = embed_dim
        self.in_conv = torch.nn.Sequential(torch.nn.LayerNorm(C), torch.nn.Linear(C, C),
                                           torch.nn.GELU())
        self.out_conv = torch.nn.Sequential(
            torch.nn.Linear(C, C // 2), torch.nn.GELU(), torch.nn.Linear(C // 2, C // 4),
            torch.nn.GELU(), torch.nn.Linear(C // 4, 2), torch.nn.LogSoftmax(dim=-1))

    def score(self, batch: TokenBatch) -> torch.Tensor:
        """(T,) float32 log-probability of keeping each row (garbage/prefix: any value)."""
        x = self.in_conv(batch.rows)
        half = x.shape[1] // 2
        # Per-image mean of the patch rows by ragvit.segment_mean (patch_means): float32
        # sums in a fixed order, so the same input always gives the same scores (a CUDA
        # index_add_ sums by atomics in any order, and its fp16 rounding noise flipped
        # top-k near-ties between two forwards of one input), by torch while the
        # predictors train; rows past cu_seqlens[B] (capacity mode) are ignored.
        means = patch_means(batch, x[:, half:])
        global_x = means[batch.seq_ids.clamp(max=batch.num_seqs - 1)]
        return self.out_conv(torch.cat([x[:, :half], global_x], dim=1))[:, 0].float()


# Held while a DynamicViT makes or moves its prediction modules (rare: once per policy and
# device); one lock for every instance keeps the policies picklable.
_PREDICTORS_LOCK = threading.Lock()


class DynamicViT(PruningPolicy):
    """DynamicViT (Rao et al., NeurIPS 2021) at inference: learned keep scores, top-k.

    At the input of each block of `layers`, stage s scores every patch token with its own
    prediction module (`DynamicViTPredictor`) and keeps the int(keep_rates[s] * n0) best
    (n0 = the image's initial patch count; at least 1); prefix tokens are always kept.
    Counts are fixed: sync-free and CUDA-graph capturable. DynamicViT orders kept tokens
    by score; ragvit keeps them in position order (attention does not care).

    Args:
        keep_rates: fractions in (0, 1] of the initial patch count, one per stage
            (DynamicViT/DeiT-S: 0.7, 0.49, 0.343).
        layers: block indices, ascending (DynamicViT: 3, 6, 9).
        predictor: the trained prediction modules: a state dict (keys `{s}.in_conv...`,
            optionally prefixed `score_predictor.`, as in DynamicViT checkpoints), a
            torch.nn.ModuleList of DynamicViTPredictor, or None for a random
            initialisation (warns: accuracy needs trained predictors), created on first
            use with the model's width, device and dtype. The modules follow the rows'
            device and dtype, one at a time: for models on two devices or in two dtypes
            called at once (two threads), give each its own policy (copy.deepcopy).

    Raises:
        ValueError: a keep rate out of (0, 1], a length mismatch, or a state dict that
            does not hold one predictor per stage.
        TypeError: layers is not a sequence of ints, a keep rate not a number, or
            predictor has an unsupported type.
    """

    is_fixed = True

    def __init__(self, keep_rates: float | Sequence[float] = (0.7, 0.49, 0.343),
                 layers: Sequence[int] = (3, 6, 9), predictor=None):
        self.layers = _layers("DynamicViT", layers)
        self.keep_rates = _per_stage("DynamicViT", "keep_rates", keep_rates, self.layers,
                                     _real, "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        self.predictors = None
        if isinstance(predictor, torch.nn.ModuleList):
            self.predictors = predictor.eval()
        elif isinstance(predictor, Mapping):
            with torch.inference_mode(False):  # see _modules_for
                self.predictors = self._from_state_dict(predictor).eval()
        elif predictor is not None:
            raise TypeError(f"DynamicViT: predictor must be a state dict, a ModuleList or "
                            f"None, got {type(predictor).__name__}")
        if self.predictors is not None and len(self.predictors) != len(self.layers):
            raise ValueError(f"DynamicViT: predictor must hold one module per layer "
                             f"({len(self.layers)}), got {len(self.predictors)}")

    def _from_state_dict(self, state: Mapping) -> torch.nn.ModuleList:
        prefix = "score_predictor."
        state = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state.items()}
        if "0.in_conv.0.weight" not in state:
            raise ValueError("DynamicViT: predictor state dict must hold "
                             "'[score_predictor.]0.in_conv.0.weight'")
        embed_dim = state["0.in_conv.0.weight"].shape[0]
        stages = len({k.split(".", 1)[0] for k in state})
        modules = torch.nn.ModuleList(DynamicViTPredictor(embed_dim) for _ in range(stages))
        modules.load_state_dict(state)
        return modules

    def __repr__(self) -> str:
        return f"DynamicViT(keep_rates={self.keep_rates}, layers={self.layers})"

    def _modules_for(self, rows: torch.Tensor) -> torch.nn.ModuleList:
        predictors = self.predictors
        if predictors is not None:
            p = next(predictors.parameters())
            if p.device == rows.device and p.dtype == rows.dtype:
                return predictors
        # Made or moved under a lock, so the first calls of two threads agree on one set of
        # modules; and outside inference mode, whatever mode the call runs in: parameters
        # made (or moved) under torch.inference_mode() would be inference tensors for good,
        # which a later call in grad mode cannot use.
        with _PREDICTORS_LOCK, torch.inference_mode(False):
            if self.predictors is None:
                warnings.warn("DynamicViT: prediction modules are randomly initialised; "
                              "accuracy needs trained predictors (pass predictor=state_dict)",
                              stacklevel=3)
                self.predictors = torch.nn.ModuleList(
                    DynamicViTPredictor(rows.shape[1]) for _ in self.layers).eval()
            p = next(self.predictors.parameters())
            if p.device != rows.device or p.dtype != rows.dtype:
                self.predictors.to(device=rows.device, dtype=rows.dtype)
            return self.predictors

    def select(self, batch: TokenBatch) -> Selection:
        if batch.num_tokens is None:
            raise ValueError("DynamicViT.select: batch.num_tokens (initial count) must be given")
        predictor = self._modules_for(batch.rows)[batch.stage]
        scores = predictor.score(batch)
        n0 = batch.num_tokens - batch.num_prefix
        k = max(1, int(n0 * self.keep_rates[batch.stage]))
        n = (batch.seq_len if batch.seq_len is not None else batch.max_seqlen) - batch.num_prefix
        return topk_selection(batch, scores, min(1.0, k / max(n, 1)))
