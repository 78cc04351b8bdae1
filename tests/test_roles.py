"""roles: a parameter's "used as" placements are read in the parameter's own dims, through the
views between it and the op that computes with it (the truth for a view: its strides)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from apmodel.reading.roles import _in_param_dims, _view_dims


def _views3(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (w.transpose(0, -1), w.permute(2, 0, 1), w.view(4, 6, 5), w.reshape(20, 6), w.detach(),
            w.to(torch.bfloat16))


def _want(node, src) -> tuple[int, ...] | None:
    """Which input dim each output dim is, from strides (the input is contiguous)."""
    val, src_val = node.meta["val"], src.meta["val"]
    if val.dtype != src_val.dtype or node.target.__name__.startswith(("detach", "alias")):
        return tuple(range(src_val.dim()))  # a cast or detach keeps the dims
    if val.dim() == src_val.dim() and sorted(val.stride()) == sorted(src_val.stride()):
        return tuple(src_val.stride().index(s) for s in val.stride())  # a permutation of the input's dims
    return None  # a reshape that mixes dims


def test_view_dims_follow_the_strides() -> None:
    seen = set()
    for fn, shape in ((_views3, (4, 5, 6)), (lambda w: (w.t(),), (4, 5))):
        gm = make_fx(fn)(torch.randn(*shape))
        src = next(n for n in gm.graph.nodes if n.op == "placeholder")
        for node in src.users:
            got = _view_dims(node, tuple(range(len(shape))))
            assert got == _want(node, src), node.format_node()
            seen.add(node.target.__name__.split(".")[0])
    assert {"t", "transpose", "permute", "view"} <= seen


def test_tokens_are_mapped_into_the_parameters_dims() -> None:
    assert _in_param_dims("S(1)", (1, 0)) == "S(0)"  # mm reading w.t() split on dim 1 reads w split on dim 0
    assert _in_param_dims("S(0)", (2, 0, 1)) == "S(2)"
    assert _in_param_dims("R", (1, 0)) == "R" and _in_param_dims("P", (1, 0)) == "P"
    assert _in_param_dims("S(1)", None) == "S(1)"  # a mixing reshape: the view's own token
