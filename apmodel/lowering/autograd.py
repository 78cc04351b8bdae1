"""The two autograd functions of a lowered step: inputs to their planned DTensors, and the
joint graph's forward and backward run as one ``torch.autograd.Function``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

if TYPE_CHECKING:
    from apmodel.lowering.program import LoweredProgram

from apmodel.lowering.graph import Placements


class FromGlobal(torch.autograd.Function):
    """A plain input (the global value, the same on every rank) -> its DTensor at the planned
    placement (local chunk, no communication). Its gradient comes back as the full global tensor:
    gathering it is the one collective outside the plan (only for inputs that require grad)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, pl: Placements) -> DTensor:
        return distribute_tensor(x.detach(), mesh, pl, src_data_rank=None)

    @staticmethod
    def backward(ctx, g: DTensor):
        return g.full_tensor(), None, None


class JointStep(torch.autograd.Function):
    """forward: the joint graph's forward nodes; backward: its backward nodes (both over DTensors)."""

    @staticmethod
    def forward(ctx, prog: LoweredProgram, device: torch.device, keep: bool, *values):
        env: dict[fx.Node, Any] = {}
        ph = prog.params + prog.buffers + prog.inputs
        for n, v in zip(ph, values, strict=False):
            env[n] = v
        ctx.param_dtypes = [v.dtype for v in values[: len(prog.params)]]
        if prog.param_dtype is not None:  # mixed precision: compute with a down-cast of the master shards
            for n, v in zip(prog.params, values, strict=False):
                if v.is_floating_point():
                    env[n] = v.to(prog.param_dtype)
        prog._run(prog.fwd_steps, env, "forward", device)
        for b, u in prog.buffer_update.items():  # BatchNorm running statistics and the like
            fqn = prog.captured.buffer_fqn[b.name]
            v = prog._redistribute(env[u], prog.storage[b], f"buffer:{fqn}", u.name, 0, "forward")
            prog.new_buffer_values[fqn] = v.to_local()
        ctx.prog = prog
        ctx.device = device
        ctx.saved_env = {n: env[n] for n in prog.saved} if keep else {}
        outs = []
        for o in prog.fwd_outputs:  # forward output -> its required placement (that of its tangent)
            t = prog.output_tangent.get(o)
            v = env[o]
            if t is not None:
                v = prog._redistribute(v, prog.storage[t], f"output:{o.name}", o.name, 0, "forward")
            outs.append(v)
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        prog: LoweredProgram = ctx.prog
        env = dict(ctx.saved_env)
        ctx.saved_env = None
        for o, g in zip(prog.fwd_outputs, grads, strict=True):
            t = prog.output_tangent.get(o)
            if t is None:
                continue
            if g is None:
                g = torch.zeros_like(env[o]) if o in env else None
            env[t] = prog._redistribute(g, prog.storage[t], t.name, "<incoming grad>", 0, "backward")
        prog._run(prog.bwd_steps, env, "backward", ctx.device)
        result: list = [None, None, None]
        for p, master_dtype in zip(prog.params, ctx.param_dtypes, strict=True):
            g = prog.param_grad.get(p)
            if g is None:
                result.append(None)
                continue
            val = prog._redistribute(env[g], prog.storage[p], f"grad:{prog.captured.param_fqn[p.name]}", g.name, 0,
                                     "backward", gradient=True)
            result.append(val.to(master_dtype))  # mixed precision: the gradient of the fp32 master
        result.extend([None] * len(prog.buffers))
        for i in prog.inputs:
            g = prog.input_grad.get(i)
            result.append(None if g is None else prog._redistribute(env[g], prog.storage[i], f"grad:input{prog.captured.input_index[i.name]}", g.name, 0, "backward"))
        return tuple(result)
