"""Single-dim DTensor rules expanded over every mesh axis, on integer codes.

A single-dim rule lists entries: one placement per output and per tensor input, for one mesh
axis. torch expands it to a D-axis mesh by taking the product of the entries over the axes and
building a ``DTensorSpec`` for every tensor of every combination
(``expand_to_full_mesh_op_strategy``): (entries)^D combinations at tens of µs of Python each,
most of a 4-axis mesh's enumeration. Here a combination is a row of entry indices and the work
per combination is a few numpy operations:

* per position (output or input) the placement tuple a combination gives is a mixed-radix number
  over the per-axis codes of its placements, so every check and rewrite runs once per distinct
  tuple of a position, not once per combination: torch's own (mixed partial kinds, input
  shardability), then the caller's (``rewrite_output`` / ``rewrite_input``: aligning outputs,
  unmasking DTensor's masked partial, the filters of :mod:`apmodel.candidates.strategies`);
* the combinations torch keeps and the caller's filters pass are deduplicated on their rewritten
  tuples, the first occurrence kept in torch's product order, and only those are built.

The result is torch's expansion followed by the caller's per-tensor rewrite, deduplication and
filters, in the same order (``tests/test_strategies.py`` compares them op by op).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from apmodel import _torch_private as tp

__all__ = ["Expansion", "all_combinations", "expand"]

Placements = tuple  # one placement per mesh axis (torch Placement objects)
#: (rewritten placement, kept) of one output slot's raw placement (None: no tensor there)
RewriteOutput = Callable[[int, "Placements | None"], "tuple[Placements | None, bool]"]
#: (rewritten placement, kept) of one tensor input's raw placement
RewriteInput = Callable[[int, Placements], "tuple[Placements, bool]"]


@dataclass(frozen=True)
class Expansion:
    """What :func:`expand` found: the kept strategies as (outputs, inputs) placements, in torch's
    order, and how many combinations torch's own expansion returns (before the caller's filters)
    with how many input placements each (``None`` when it returns none)."""

    strategies: list[tuple[tuple[Placements | None, ...], tuple[Placements, ...]]]
    raw: int
    raw_inputs: int | None


def all_combinations(n_entries: int, n_axes: int) -> np.ndarray:
    """Every combination of entry indices over ``n_axes`` axes, in ``itertools.product`` order."""
    grids = np.indices((n_entries,) * n_axes).reshape(n_axes, -1)
    return np.ascontiguousarray(grids.T, dtype=np.int64)


def _rank(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys and each key's index among them."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    return uniq, inverse.reshape(-1)


def _combine(key: np.ndarray, ids: np.ndarray, n_ids: int) -> np.ndarray:
    """Rank of the pair (key, id) per row: keys of several columns kept small as they grow."""
    return _rank(key * n_ids + ids)[1]


def expand(
    rule: tp.SingleDimRule,
    combos: np.ndarray,
    n_out_slots: int,
    rewrite_output: RewriteOutput,
    rewrite_input: RewriteInput,
) -> Expansion:
    """The strategies of ``rule`` (an exact :class:`~apmodel._torch_private.SingleDimRule`) over
    ``combos`` (combinations x mesh axes: an entry index per axis, in the order torch would visit
    them), rewritten and filtered per tensor by the caller.

    ``rewrite_output(i, raw)`` gets output slot ``i`` (``0 <= i < n_out_slots``) and the rule's
    placement there (``None`` where the rule gives none, or past its outputs);
    ``rewrite_input(j, raw)`` the ``j``-th tensor input. Each returns the rewritten placement and
    whether the strategy may keep it; both are asked once per distinct placement. Raises as
    torch's expansion does (an input count that does not match, a missing single output).
    """
    entries, nout = rule.entries, rule.num_outputs
    n = len(combos)
    if n == 0 or not entries:
        return Expansion([], 0, None)
    width = len(entries[0])
    first = combos[:, 0]
    absent, positions = _position_tuples(entries, combos)
    raw_ok = np.ones(n, dtype=bool)
    kept = np.ones(n, dtype=bool)
    finals: dict[object, int] = {}  # rewritten placement -> id
    per_slot: list[tuple[np.ndarray, list[int]]] = []  # output slots, then input positions

    def mixed(tuples: list[Placements | None]) -> np.ndarray:
        return np.array([t is not None and tp.mixed_partials((t,)) for t in tuples], dtype=bool)

    for inverse, tuples in positions:
        raw_ok &= ~mixed(tuples)[inverse]
    # torch's per-combination errors, among the combinations without mixed partials
    in_positions = list(range(nout, width))
    n_inputs = (~absent[:, nout:]).sum(axis=1) if width > nout else np.zeros(len(entries), dtype=np.int64)
    _raise_as_torch(rule, raw_ok, n_inputs[first], absent[first, 0] if nout == 1 else None)

    for i in range(n_out_slots):
        if i < nout:
            inverse, tuples = positions[i]
        else:
            inverse, tuples = np.zeros(n, dtype=np.int64), [None]
        ids, ok = [], []
        for t in tuples:
            final, keep = rewrite_output(i, t)
            ids.append(finals.setdefault(final, len(finals)))
            ok.append(keep)
        kept &= np.array(ok, dtype=bool)[inverse]
        per_slot.append((inverse, ids))
    # inputs: the j-th present input position of a combination is its j-th tensor input
    # (every combination left has len(rule.inputs) of them); patterns of absent positions
    # follow the first axis' entry
    slot_of = np.cumsum(~absent[:, nout:], axis=1) - 1 if in_positions else np.zeros((len(entries), 0), dtype=np.int64)
    for k, pos in enumerate(in_positions):
        inverse, tuples = positions[pos]
        present = ~absent[first, pos]
        j_of = slot_of[first, k]
        # distinct (input index, tuple) pairs of this position
        pair = _rank(np.where(present, j_of, -1) * len(tuples) + inverse)
        ids, ok_raw, ok_keep = [], [], []
        for p in pair[0].tolist():
            if p < 0:
                ids.append(-1)
                ok_raw.append(True)
                ok_keep.append(True)
                continue
            j, t = divmod(p, len(tuples))
            placed = tuples[t]
            ok_raw.append(rule.input_shardable(j, placed))
            final, keep = rewrite_input(j, placed)
            ids.append(finals.setdefault(final, len(finals)))
            ok_keep.append(keep)
        raw_ok &= np.array(ok_raw, dtype=bool)[pair[1]]
        kept &= np.array(ok_keep, dtype=bool)[pair[1]]
        per_slot.append((pair[1], ids))
    raw = int(raw_ok.sum())
    kept &= raw_ok
    rows = np.flatnonzero(kept)
    if len(rows) == 0:
        return Expansion([], raw, len(rule.inputs) if raw else None)
    return Expansion(_distinct_strategies(rows, per_slot, finals, n_out_slots), raw, len(rule.inputs))


def _position_tuples(entries: Sequence[Sequence[Any]], combos: np.ndarray,
                     ) -> tuple[np.ndarray, list[tuple[np.ndarray, list[Placements | None]]]]:
    """Whether each entry's position is absent (None: then its spec is None when the first axis'
    entry has None there, as torch builds it), and per position: each combination's index of its
    distinct tuple there (one placement per mesh axis), and those tuples."""
    width = len(entries[0])
    n_axes = combos.shape[1]
    # codes: every distinct placement in the entries (None included) -> a small int
    codes: dict[object, int] = {}
    table = np.array([[codes.setdefault(e[pos], len(codes)) for pos in range(width)] for e in entries],
                     dtype=np.int64).reshape(len(entries), width)
    values = list(codes)
    radix = len(values)
    weights = radix ** np.arange(n_axes - 1, -1, -1, dtype=np.int64)
    absent = np.array([[e[pos] is None for pos in range(width)] for e in entries], dtype=bool)
    first = combos[:, 0]

    def position(pos: int) -> tuple[np.ndarray, list[Placements | None]]:
        packed = table[combos, pos] @ weights
        packed[absent[first, pos]] = -1
        uniq, inverse = _rank(packed)
        tuples: list[Placements | None] = []
        for key in uniq.tolist():
            if key < 0:
                tuples.append(None)
                continue
            digits = []
            for _ in range(n_axes):
                key, d = divmod(key, radix)
                digits.append(values[d])
            tuples.append(tuple(reversed(digits)))
        return inverse, tuples

    return absent, [position(pos) for pos in range(width)]


def _raise_as_torch(rule: tp.SingleDimRule, raw_ok: np.ndarray, n_inputs: np.ndarray, output_absent: np.ndarray | None) -> None:
    """torch's per-combination errors, at the first combination (among ``raw_ok``) that has one:
    an input count (``n_inputs``, per combination) other than the rule's, or a single output
    whose spec is None (``output_absent``, per combination; None when the rule has several)."""
    bad_count = raw_ok & (n_inputs != len(rule.inputs))
    bad_output = raw_ok & output_absent if output_absent is not None else np.zeros(len(raw_ok), dtype=bool)
    if bad_count.any() or bad_output.any():
        at = int(np.flatnonzero(bad_count | bad_output)[0])
        if bad_count[at]:
            raise AssertionError(f"{rule.op}: {int(n_inputs[at])} input placements for {len(rule.inputs)} "
                                 f"tensor inputs")
        raise RuntimeError(f"{rule.op}: output spec is None")


def _distinct_strategies(rows: np.ndarray, per_slot: list[tuple[np.ndarray, list[int]]], finals: dict[object, int],
                         n_out_slots: int) -> list[tuple[tuple[Placements | None, ...], tuple[Placements, ...]]]:
    """The strategies of the kept combinations ``rows``, each distinct one once (its first
    combination), as (outputs, present inputs) of rewritten placements."""
    key = np.zeros(len(rows), dtype=np.int64)
    for inverse, ids in per_slot:  # ids are -1 (absent input) or a final's id
        key = _combine(key, np.asarray(ids, dtype=np.int64)[inverse[rows]] + 1, len(finals) + 1)
    _, first_rows = np.unique(key, return_index=True)
    chosen = rows[np.sort(first_rows)]
    by_id: dict[int, Any] = {v: k for k, v in finals.items()}
    out: list[tuple[tuple[Placements | None, ...], tuple[Placements, ...]]] = []
    out_slots, in_slots = per_slot[:n_out_slots], per_slot[n_out_slots:]
    for r in chosen.tolist():
        outs = tuple(by_id[ids[inverse[r]]] for inverse, ids in out_slots)
        ins = tuple(by_id[ids[inverse[r]]] for inverse, ids in in_slots if ids[inverse[r]] >= 0)
        out.append((outs, ins))
    return out
