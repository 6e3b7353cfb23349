"""Token-pruning policies for ragvit.patch: score tokens, choose which ones to keep.

A policy sees a `TokenBatch` (the packed `(T, C)` rows of a batch at one pruning point,
their `cu_seqlens`, and optionally the head-mean CLS attention of the previous attention
call) and returns a `Selection`: either per-image keep indices (fixed counts, sync-free,
capturable in a CUDA graph exactly) or a `(T,)` keep mask over the packed rows (counts
that depend on the data). Policies own no kernels: they use small device-side torch ops
and never read device memory on the host, so the patched forward stays sync-free.
The same policy object drives the packed pipeline (`ragvit.patch`) and the padded-masked
reference (`ragvit.reference.vit_forward_reference`), so both make the same decisions.

Pruning point `layers=(i, ...)`: tokens are pruned at the input of block i (after i
blocks have run); `cls_attn` then comes from block i-1's attention call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["PruningPolicy", "Selection", "ThresholdL2", "TokenBatch"]


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
        stage: 0 for the policy's first pruning point, 1 for the second, ...
        cls_attn: (T,) float32 head-mean softmax attention of each image's first token
            over its keys in the previous attention call, when the policy asked for it.
    """

    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    num_prefix: int
    seq_len: int | None
    max_seqlen: int
    layer: int
    stage: int
    cls_attn: torch.Tensor | None = None

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
        index: (B, k) int64 positions within each image, ascending, the prefix positions
            0..P-1 first; only when the batch's seq_len is known. Every image keeps k
            tokens: sync-free and exact under CUDA-graph capture.
        keep: (T,) bool over the packed rows (prefix rows are kept regardless); counts
            depend on the data (an eager forward reads the new total once; capacity mode
            does not).
        max_seqlen: optional host upper bound on the kept length of every image.
    """

    index: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    max_seqlen: int | None = None

    def __post_init__(self):
        if (self.index is None) == (self.keep is None):
            raise ValueError("Selection: exactly one of index and keep must be given")


class PruningPolicy:
    """Base class of pruning policies.

    Subclasses set `layers` (ascending block indices, see the module docs), set
    `needs_cls_attn` when `select` reads `batch.cls_attn`, set `is_fixed` to False when
    per-image counts depend on token values, and implement `select`.
    """

    layers: tuple[int, ...] = ()
    needs_cls_attn: bool = False
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
        """Raises ValueError unless the pruning points fit a model with `depth` blocks."""
        layers = tuple(self.layers)
        if not layers:
            raise ValueError(f"{type(self).__name__}: layers must not be empty")
        if list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= depth:
            raise ValueError(
                f"{type(self).__name__}: layers must be ascending block indices in "
                f"[0, {depth}), got {layers}"
            )
        if self.needs_cls_attn and layers[0] == 0:
            raise ValueError(
                f"{type(self).__name__}: layer 0 has no previous attention for cls_attn")


def kept_count(keep_ratio: float, num_patches: int) -> int:
    """Patch tokens kept out of num_patches: ceil(keep_ratio * n), at least 1 (0 if n == 0)."""
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
    """
    P = batch.num_prefix
    if batch.seq_len is not None:
        B, L = batch.num_seqs, batch.seq_len
        k = kept_count(keep_ratio, L - P)
        patch_scores = scores.view(B, L)[:, P:]
        top = torch.topk(patch_scores.float(), k, dim=1, sorted=False).indices
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
    """(B+1,) float32 mean of `scores` over each image's patch tokens (slot B: garbage)."""
    w = batch.is_patch.float()
    sums = torch.zeros(batch.num_seqs + 1, device=scores.device).index_add_(
        0, batch.seq_ids, scores.float() * w)
    counts = torch.zeros(batch.num_seqs + 1, device=scores.device).index_add_(0, batch.seq_ids, w)
    return sums / counts.clamp(min=1)


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
        ValueError: not exactly one of keep/threshold, a value out of range, or a
            per-stage sequence whose length differs from layers.
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
        self.layers = tuple(int(i) for i in layers)
        value = keep if keep is not None else threshold
        values = (tuple(float(v) for v in value) if isinstance(value, Sequence)
                  else (float(value),) * len(self.layers))
        if len(values) != len(self.layers):
            raise ValueError(
                f"ThresholdL2: one value per layer needed, got {len(values)} for {self.layers}")
        name = "keep" if keep is not None else "threshold"
        for v in values:
            ok = 0.0 < v <= 1.0 if keep is not None else 0.0 < v < math.inf
            if not ok:
                rule = "in (0, 1]" if keep is not None else "finite and > 0"
                raise ValueError(f"ThresholdL2: {name} must be {rule}, got {v}")
        self.keep = values if keep is not None else None
        self.threshold = values if threshold is not None else None
        self.is_fixed = keep is not None

    def __repr__(self) -> str:
        mode = f"keep={self.keep}" if self.keep is not None else f"threshold={self.threshold}"
        return f"ThresholdL2({mode}, layers={self.layers})"

    def select(self, batch: TokenBatch) -> Selection:
        scores = torch.linalg.vector_norm(batch.rows.float(), dim=-1)
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
