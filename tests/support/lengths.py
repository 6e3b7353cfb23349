"""Named sequence-length sets of the attention tests: name -> fn(gen, on_cuda) -> (lengths, T).

The sets hold the shapes that expose bugs: seqlen 1, DeiT's 197 and 577, lengths around the
64-row tile, one long sequence among many short ones, zero-length sequences, S = 256, and
cu_seqlens[S] < T (capacity rows past the last sequence). T is the total the tensors are
allocated with. CPU sets are smaller where the CUDA ones would take seconds on the C backend.
"""

from __future__ import annotations

from support.inputs import random_lengths


def one_token(gen, on_cuda):
    return [1], 1


def deit_197(gen, on_cuda):
    return [197], 197


def deit_577(gen, on_cuda):
    return [577], 577


def ragged_mix(gen, on_cuda):
    if on_cuda:
        lengths = random_lengths(gen, 32, 1, 577, include=(1, 197, 198, 577))
    else:
        lengths = random_lengths(gen, 6, 2, 96, include=(1, 65, 197, 577))
    return lengths, sum(lengths)


def many_seqs_256(gen, on_cuda):
    if on_cuda:
        lengths = random_lengths(gen, 256, 1, 300, include=(1, 197, 577))
    else:
        lengths = random_lengths(gen, 256, 0, 12, include=(1, 0))
    return lengths, sum(lengths)


def zero_length(gen, on_cuda):
    lengths = [0, 5, 0, 0, 37, 1, 0] if not on_cuda else [0, 5, 0, 0, 197, 1, 0, 64, 0]
    return lengths, sum(lengths)


def capacity_tail(gen, on_cuda):
    # cu_seqlens[S] < T: the rows past the last sequence are capacity, never read or written.
    lengths = [0, 13, 64, 1] if not on_cuda else [0, 13, 197, 1, 64]
    return lengths, sum(lengths) + 17


def tile_edges(gen, on_cuda):
    return [63, 64, 65, 127, 128, 129, 198], 774


def long_among_short(gen, on_cuda):
    lengths = [3, 1, 2, 257, 5, 1, 4] if not on_cuda else [3, 1, 2, 577, 5, 1, 4, 2, 7, 1]
    return lengths, sum(lengths)


LENGTH_SETS = {
    "one_token": one_token,
    "deit_197": deit_197,
    "deit_577": deit_577,
    "ragged_mix": ragged_mix,
    "many_seqs_256": many_seqs_256,
    "zero_length": zero_length,
    "capacity_tail": capacity_tail,
    "tile_edges": tile_edges,
    "long_among_short": long_among_short,
}
