"""`Builder`: what op converters (`ops.py`) call to add Kiln nodes. Pure Python and NumPy.

It names nodes after their module (a leaf module's op is named by the module's path, an op written
inline in a `forward` is `<module path>.<op>`, Kiln's convention), turns constants into weight
nodes under their names, and keeps Kiln's one rule about shapes: the batch is dim 0 of every value.
A PyTorch value whose batch is merged with other rows (window attention's `[B·64, 49, C]`) is held
*lifted*, `[B, 64, 49, C]`, and one whose batch PyTorch moved to another dim is held with the batch
still first (`Act.bdim`), so the graph runs at any batch whatever the example batch (see
`graph.Act`). An op across the images is refused (`Builder.along`), never computed wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import ops
from .graph import Act, Const, KilnGraph
from .ops import Unsupported


@dataclass
class Unknown:
    """A value that could not be converted (its node is in the report); its readers are skipped."""

    tshape: tuple


def plan(values, converter, has_schema: bool = True) -> str:
    """What the exporter does with a node, given its (converted) input values and the converter
    its op has (`None`: Kiln has no such op):

    - `missing`: Kiln has no such op, and the report lists it, even when an input is itself
      `Unknown` (downstream of another unsupported node: the report is every node at once);
    - `skip`: an input is `Unknown`, but the op is supported: the node upstream is reported;
    - `fold`: no input is an activation, so PyTorch computes it once, as a constant;
    - `convert`: the converter makes its Kiln nodes.
    """
    values = list(values)
    if not any(isinstance(v, (Act, Unknown)) for v in values):
        return "fold"
    if converter is None or not has_schema:
        return "missing"
    if any(isinstance(v, Unknown) for v in values):
        return "skip"
    return "convert"


def broadcast(a, b):
    return tuple(np.broadcast_shapes(tuple(a), tuple(b)))


class Builder:
    def __init__(self, graph: KilnGraph | None = None):
        self.graph = graph or KilnGraph()
        self.scope = ""
        self.leaf = False
        self.fx_name = ""
        self.target = ""
        self.out_shape: tuple = ()
        self._named = False
        # `pad(x) + C` nodes of a cat with constants (see `merge_constant_adds`).
        self.cat_constant_adds: set = set()
        # The example batch (dim 0 of the first input): above 1, values whose batch PyTorch moved
        # are held with `Act.bdim` (see `graph.Act`) instead of lifted.
        self.batch = 1
        # PT2E's `quantize` nodes (id → (its input, its params)) and the fake-quantisers their
        # dequantizes became ((input id, params) → Act), see `ops._decomposed_dequantize`.
        self.quantized: dict = {}
        self.fake_quantized: dict = {}

    # ---- context of the node being converted

    def begin(self, target: str, fx_name: str, scope: str, leaf: bool, out_shape) -> None:
        self.target, self.fx_name, self.scope, self.leaf = target, fx_name, scope, leaf
        self.out_shape = tuple(out_shape) if out_shape is not None else ()
        self._named = False

    def path(self, name: str, helper: bool = False) -> str:
        """A leaf module's first op takes the module's path; other ops are `<scope>.<name>`."""
        if self.leaf and not helper and not self._named:
            self._named = True
            return self.scope
        return f"{self.scope}.{name}" if self.scope else name

    # ---- nodes

    def _id(self, v) -> int:
        if isinstance(v, Act):
            return v.id
        if isinstance(v, Const):
            return self.graph.weight(v.name, to_numpy(v.value), v.quant)
        raise Unsupported(f"an input of Kiln op is {v!r}")

    def node(self, op, inputs, name, tshape=None, lifted=None, helper=False, bdim=None) -> Act:
        """A Kiln node of `op` on `inputs`, holding the PyTorch value of shape `tshape` (default:
        the node's). `bdim`: where its batch is when PyTorch moved it (see `graph.Act`); only the
        callers that map dims through `Act.kdim` give it, and an elementwise op (`Unary`) keeps
        its input's; any other op on such a value is refused here rather than computed wrong."""
        acts = [v for v in inputs if isinstance(v, Act)]
        if lifted is None:
            lifted = bool(acts) and acts[0].lifted
        tshape = self.out_shape if tshape is None else tuple(tshape)
        moved = [v for v in acts if v.moved]
        if lifted:
            bdim = self._lifted_bdim(op, acts, tshape, bdim)
        elif bdim is None:
            bdim = 0
            if moved:
                if "Unary" in op and len(acts) == 1:
                    bdim = moved[0].bdim
                else:
                    raise Unsupported(
                        f"it reads a value of shape {list(moved[0].tshape)} whose batch (exported at {self.batch}) PyTorch "
                        f"moved to dim {moved[0].bdim}, and Kiln cannot follow the batch through {op_family(op)}; "
                        "export at batch 1 (the graph then runs at any batch)"
                    )
        out = Act(-1, tuple(int(d) for d in tshape), lifted, bdim, self.batch if lifted else 1)
        nid = self.graph.push(op, [self._id(v) for v in inputs], out.kshape, self.path(name, helper))
        out.id = nid
        return out

    def _lifted_bdim(self, op, acts, tshape, bdim) -> int:
        """The merged batch's dim of a lifted node's value (see `graph.Act`). At batch 1 it is 0:
        a lifted value is `[1, *tshape]` whatever PyTorch did with the batch of 1. Above, the
        lifted inputs must hold it in the same dim (`bdim`, when the caller mapped it, is where
        it goes), and it must divide into whole images."""
        if self.batch == 1:
            return 0
        lifted = [v for v in acts if v.lifted]
        if bdim is None:
            dims = {v.bdim for v in lifted}
            ranks = {len(v.tshape) for v in lifted}
            if len(dims) > 1 or len(ranks) > 1 or any(not v.lifted for v in acts):
                raise Unsupported(
                    f"it reads values whose batch (exported at {self.batch}) is merged into different dims {sorted(dims)} "
                    f"(shapes {[list(v.tshape) for v in acts]}), and Kiln cannot follow the batch through {op_family(op)}"
                )
            bdim = dims.pop() if dims else 0
            if bdim and len(tshape) != len(lifted[0].tshape):
                raise Unsupported(f"{op_family(op)} changes the rank of a value whose batch is merged into dim {bdim}")
        if not 0 <= bdim < len(tshape) or tshape[bdim] % self.batch:
            raise Unsupported(f"its value of shape {list(tshape)} does not hold the {self.batch} images of the batch whole in dim {bdim}")
        return bdim

    def reduced_bdim(self, x: Act, dims, keepdim: bool) -> int:
        """The batch's dim after reducing `dims` (which must not hold it) of `x`."""
        if keepdim or (x.lifted and self.batch == 1):
            return x.bdim
        return x.bdim - sum(1 for d in dims if d < x.bdim)

    def along(self, x: Act, dims, what: str) -> Act:
        """`x` ready for an op along PyTorch dims `dims` (a reduction, a softmax, a slice, a cat,
        a roll). When they hold the batch: at batch 1 `x` is lifted, so that the op runs per
        image, as Kiln runs every op; above 1 the op would mix the images, and it is refused."""
        if x.bdim not in dims:
            return x
        if self.batch == 1:
            return self.lift(x)
        merged = " merged with other rows" if x.lifted and x.tshape[x.bdim] != self.batch else ""
        raise Unsupported(
            f"{what} along dim {x.bdim} of a value of shape {list(x.tshape)}, which holds the batch{merged} (exported at "
            f"batch {self.batch}): the op mixes the images, and Kiln computes each image on its own"
        )

    def const_value(self, value, suffix: str) -> Const:
        base = f"{self.scope}.{self.fx_name}" if self.scope else self.fx_name
        name = f"{base}.{suffix}" if suffix else base
        return Const(name, np.asarray(value, dtype=np.float32))

    # ---- the batch stays dim 0

    def lift(self, x: Act) -> Act:
        """`x` as a lifted value (`graph.Act`): `[1, *shape]` at batch 1, for ops that touch
        PyTorch's dim 0; above, the batch's dim `bdim` as a merged dim of one row per image, so
        that a reshape may then merge it with other dims (window attention)."""
        if x.lifted:
            return x
        if not x.tshape or x.tshape[x.bdim] != self.batch:
            raise Unsupported(
                f"it moves or merges dim 0 of a value of shape {list(x.tshape)}, the batch: Kiln keeps the batch as dim 0"
            )
        dims = list(x.tshape)
        dims[x.bdim] = 1
        return self.node(ops.shape_op("Reshape", dims=dims), [x], "reshape", x.tshape, lifted=True, helper=True, bdim=x.bdim)

    def unlift(self, x: Act) -> Act:
        """`x` with PyTorch's dim 0 as the batch again (its dim 0 must be 1)."""
        if x.moved:
            raise Unsupported(
                f"it needs the batch as dim 0, but its input of shape {list(x.tshape)} has the batch in dim {x.bdim} "
                "(exported at a batch above 1); export at batch 1 (the graph then runs at any batch)"
            )
        if not x.lifted:
            return x
        if not x.tshape or x.bdim != 0 or x.tshape[0] != self.batch:
            raise Unsupported(
                f"it needs the batch as dim 0, but its input of shape {list(x.tshape)} has the batch merged into dim 0 "
                "(Kiln runs images, not windows or tokens, as the batch)"
            )
        return self.node(ops.shape_op("Reshape", dims=list(x.tshape[1:])), [x], "reshape", x.tshape, lifted=False, helper=True)

    def batched(self, x: Act, rank: int, what: str) -> Act:
        if len(x.tshape) != rank:
            raise Unsupported(f"{what} of a {len(x.tshape)}-D value of shape {list(x.tshape)} (Kiln's takes {rank}-D)")
        return self.unlift(x)

    # ---- data movement and arithmetic shared by several converters

    def reshape(self, x: Act, tshape) -> Act:
        tshape = tuple(int(d) for d in tshape)
        if tshape == tuple(x.tshape):
            return x
        if self.batch > 1 and not x.lifted:
            nb = reshaped_bdim(x.tshape, x.bdim, tshape)
            if nb is not None and (x.moved or nb != 0):
                dims = list(tshape[:nb]) + list(tshape[nb + 1 :])
                return self.node(ops.shape_op("Reshape", dims=dims), [x], "reshape", tshape, bdim=nb)
            if nb is None and x.moved:
                # The moved batch merges with the dims after it (an einsum's batched matmul).
                return self._reshape_lifted(self.lift(x), tshape)
        if not x.lifted and x.tshape and tshape and tshape[0] == x.tshape[0]:
            start = len(tshape) - 1
            if 1 <= start < len(x.tshape) and tshape[:start] == tuple(x.tshape[:start]) and tshape[-1] == math.prod(x.tshape[start:]):
                return self.node(ops.shape_op("Flatten", start=start), [x], "flatten", tshape)
            return self.node(ops.shape_op("Reshape", dims=list(tshape[1:])), [x], "reshape", tshape)
        if not x.lifted:
            x = self.lift(x)
        return self._reshape_lifted(x, tshape)

    def _reshape_lifted(self, x: Act, tshape) -> Act:
        """A reshape of a lifted value. At batch 1 any reshape (the images are 1). Above, the
        images stay whole: one that keeps the dims before the merged batch's and whose dim there
        is whole images (the images are outermost in it, so for each index of the dims before,
        each image's rows are one block before and after), or one that only adds or drops dims
        of size 1."""
        B, d = self.batch, x.bdim
        if B == 1:
            if tshape and tshape[0] == 1:
                return self.node(ops.shape_op("Reshape", dims=list(tshape[1:])), [x], "reshape", tshape, lifted=False)
            return self.node(ops.shape_op("Reshape", dims=list(tshape)), [x], "reshape", tshape, lifted=True)
        if len(tshape) > d and tuple(tshape[:d]) == tuple(x.tshape[:d]) and tshape[d] % B == 0:
            nb = d
        elif d and all(s == 1 for s in x.tshape[:d]) and tshape and tshape[0] % B == 0:
            # Only dims of size 1 before the merged batch: its images are the outermost blocks of
            # the whole value, and so they are of the new dim 0 (`[1, B·W, C]` back to `[B, W, C]`).
            nb = 0
        else:
            nb = reshaped_bdim(x.tshape, x.bdim, tshape)
        if nb is None or tshape[nb] % B:
            raise Unsupported(
                f"a reshape of {list(x.tshape)} to {list(tshape)} splits the images of the batch (exported at {B}, "
                f"merged into dim {x.bdim}): Kiln computes each image on its own"
            )
        if nb == 0 and tshape[0] == B:
            return self.node(ops.shape_op("Reshape", dims=list(tshape[1:])), [x], "reshape", tshape, lifted=False)
        dims = list(tshape)
        dims[nb] //= B
        return self.node(ops.shape_op("Reshape", dims=dims), [x], "reshape", tshape, lifted=True, bdim=nb)

    def permute(self, x: Act, dims) -> Act:
        dims = [int(d) for d in dims]
        if dims == list(range(len(dims))):
            return x
        out = tuple(x.tshape[d] for d in dims)
        if not x.lifted and (self.batch > 1 or x.moved):
            # The batch stays Kiln's dim 0 and goes to PyTorch's dim `nb`; the other dims follow.
            nb = dims.index(x.bdim)
            perm = [0] + [x.kdim(dims[j]) for j in range(len(dims)) if j != nb]
            if perm == list(range(len(perm))):
                return Act(x.id, out, False, nb)
            return self.node(ops.shape_op("Permute", dims=perm), [x], "permute", out, bdim=nb)
        if not x.lifted and dims[0] == 0:
            return self.node(ops.shape_op("Permute", dims=dims), [x], "permute", out)
        x = self.lift(x)
        return self.node(ops.shape_op("Permute", dims=[0] + [d + 1 for d in dims]), [x], "permute", out, bdim=dims.index(x.bdim))

    def slice(self, x: Act, d: int, start: int, end: int, step: int = 1) -> Act:
        n = x.tshape[d]
        if step < 1:
            raise Unsupported(f"a slice with step {step}")
        if start == 0 and end >= n and step == 1:
            return x
        x = self.along(x, [d], "a slice")
        if step == 1:
            return self._narrow(x, d, start, end - start)
        # x[start:end:step] along d: narrow (or pad) to count·step, view as [.., count, step, ..], keep
        # index 0 of the step axis, and drop it.
        count = -(-(end - start) // step)
        span = count * step
        shape = list(x.tshape)
        if start + span <= n:
            x = self._narrow(x, d, start, span)
        else:
            x = self._narrow(x, d, start, n - start)
            extra = start + span - n
            rank = len(x.kshape)
            kd = x.kdim(d)
            pads = [0, 0] * (rank - 1 - kd) + [0, extra]
            shape[d] = span
            x = self.node(ops.shape_op("Pad", pads=pads, value=0.0), [x], "pad", shape, helper=True, bdim=x.bdim)
        split = list(x.tshape[:d]) + [count, step] + list(x.tshape[d + 1 :])
        x = self.reshape(x, split)
        x = self._narrow(x, d + 1, 0, 1)
        return self.reshape(x, split[: d + 1] + split[d + 2 :])

    def _narrow(self, x: Act, d: int, start: int, length: int) -> Act:
        if start == 0 and length == x.tshape[d]:
            return x
        shape = list(x.tshape)
        shape[d] = length
        return self.node(ops.shape_op("Slice", dim=x.kdim(d), start=int(start), len=int(length)), [x], "slice", shape, bdim=x.bdim)

    def cat(self, parts, d: int) -> Act:
        acts = [i for i, p in enumerate(parts) if isinstance(p, Act)]
        if not acts:
            raise Unsupported("cat of constants only (it should have been folded)")
        if acts != list(range(acts[0], acts[-1] + 1)):
            raise Unsupported("cat of activations with constants between them")
        run = [parts[i] for i in acts]
        if len(run) > 1:
            run = [self.along(p, [d], "a cat") for p in run]
            if len({p.lifted for p in run}) > 1:
                run = [self.lift(p) for p in run]
            if len({p.bdim for p in run}) > 1:
                raise Unsupported(f"cat of values whose batch is in different dims {[p.bdim for p in run]}")
        out = list(run[0].tshape)
        out[d] = sum(p.tshape[d] for p in run)
        y = run[0]
        if len(run) > 1:
            y = self.node(ops.shape_op("Cat", dim=run[0].kdim(d)), run, "cat", out, bdim=run[0].bdim)
        before, after = parts[: acts[0]], parts[acts[-1] + 1 :]
        if not before and not after:
            return y
        return self._cat_constants(y, before, after, d)

    def _cat_constants(self, y: Act, before, after, d: int) -> Act:
        """`cat([c.., y, c..], d)` with constants `c` as `pad(y) + C`: zeros where the constants are
        in `pad(y)`, zeros where `y` is in `C`, so every element is one exact sum with 0 (ViT's
        class token). Unlike a cat with a constant, it broadcasts over the batch."""
        if d == 0:
            raise Unsupported("cat of a constant along dim 0, the batch")
        if y.moved:
            raise Unsupported(f"cat of a constant with a value whose batch is in dim {y.bdim}; export at batch 1")
        before, after = [self.per_image(c) for c in before], [self.per_image(c) for c in after]
        lo, hi = sum(c.tshape[d] for c in before), sum(c.tshape[d] for c in after)
        out = list(y.tshape)
        out[d] += lo + hi
        kd, rank = d + y.offset, len(y.kshape)
        pads = [0, 0] * (rank - 1 - kd) + [lo, hi]
        padded = self.node(ops.shape_op("Pad", pads=pads, value=0.0), [y], "pad", out)
        full = np.zeros([1] + out[1:], np.float32)
        offset = 0
        for c in before:
            idx = [slice(None)] * len(out)
            idx[d] = slice(offset, offset + c.tshape[d])
            full[tuple(idx)] = to_numpy(c.value)
            offset += c.tshape[d]
        offset = lo + y.tshape[d]
        for c in after:
            idx = [slice(None)] * len(out)
            idx[d] = slice(offset, offset + c.tshape[d])
            full[tuple(idx)] = to_numpy(c.value)
            offset += c.tshape[d]
        y = self.binary("Add", padded, self.const_value(full, "cat_constants"), tshape=out)
        self.cat_constant_adds.add(y.id)
        return y

    def per_image(self, c: Const) -> Const:
        """A constant of the example batch's size in dim 0 whose rows are all equal (a class token
        or a mask `expand`ed to the batch, computed while exporting) as its one row, so that it
        broadcasts over any batch; any other constant as it is."""
        v = to_numpy(c.value)
        if self.batch > 1 and v.ndim >= 1 and v.shape[0] == self.batch and np.array_equal(v, np.broadcast_to(v[:1], v.shape)):
            return Const(f"{c.name}.per_image", v[:1])
        return c

    def binary(self, op: str, x, y, tshape=None) -> Act:
        """`x op y` with broadcasting; `x` an activation, `y` an activation or a constant."""
        out = broadcast(x.tshape, y.tshape)
        if self.batch > 1 and isinstance(y, Act) and len(x.tshape) != len(y.tshape):
            # Of two ranks (an LSTM step's `[B·W, 4H]` and the `[1, B·W, 4H]` of its state): the
            # lower takes leading dims of size 1 (see the constant's case below), then both must
            # hold the batch in the same dim.
            rank = max(len(x.tshape), len(y.tshape))
            x, y = (self.reshape(v, (1,) * (rank - len(v.tshape)) + tuple(v.tshape)) for v in (x, y))
        if isinstance(y, Act):
            if self.batch > 1 and (x.lifted or y.lifted):
                # Both with the batch merged into the same dim (checked by `node`).
                x, y = self.lift(x), self.lift(y)
                return self.node(ops.binary(op), [x, y], op.lower(), out if tshape is None else tshape)
            if x.moved or y.moved:
                if x.lifted or y.lifted or x.bdim != y.bdim or len(x.tshape) != len(y.tshape):
                    raise Unsupported(f"{op.lower()} of values whose batch is in different dims; export at batch 1")
                return self.node(ops.binary(op), [x, y], op.lower(), out if tshape is None else tshape, bdim=x.bdim)
            if x.lifted != y.lifted or len(x.tshape) != len(y.tshape):
                x, y = self.lift(x), self.lift(y)
            return self.node(ops.binary(op), [x, y], op.lower(), out if tshape is None else tshape)
        if self.batch > 1 and len(y.tshape) > len(x.tshape):
            # A constant of more dims than the value (an LSTM's folded `h0 @ W_hh + b`, `[1, B·W,
            # 4H]`, added to a step's `[B·W, 4H]`): the value first takes its leading dims as dims
            # of size 1, a reshape that keeps the images whole wherever the batch is (merged,
            # moved or first), then the constant is read per image as for one of equal rank.
            x = self.reshape(x, (1,) * (len(y.tshape) - len(x.tshape)) + tuple(x.tshape))
        if x.lifted and self.batch > 1:
            y = self._per_image_merged(x, y)
        elif len(y.tshape) == len(x.tshape) and not x.moved:
            y = self.per_image(y)
        if x.moved:
            return self._binary_moved(op, x, y, out if tshape is None else tshape)
        rank_c = len(y.tshape)
        needs_lift = rank_c > len(x.tshape) or (rank_c == len(x.tshape) and not x.lifted and y.tshape and y.tshape[0] != 1)
        if needs_lift and self.batch > 1:
            raise Unsupported(
                f"{op.lower()} of a value of shape {list(x.tshape)} with a constant of shape {list(y.tshape)} that differs "
                f"between the images of the batch (exported at {self.batch}), or broadcasts the batch into another dim"
            )
        if needs_lift:
            x = self.lift(x)
        if x.lifted and rank_c > len(x.tshape):
            y = Const(f"{y.name}.unsqueezed", to_numpy(y.value).reshape((1,) + tuple(y.tshape)))
        return self.node(ops.binary(op), [x, y], op.lower(), out if tshape is None else tshape)


    def _per_image_merged(self, x: Act, c: Const) -> Const:
        """The constant operand of a lifted `x` whose dim `bdim` merges the images (exported at a
        batch above 1) as the block of one image along that dim, so that it broadcasts over
        Kiln's `[batch, ..., rows of one image, ...]`: a mask `expand`ed to every window of every
        image. A constant whose blocks differ would make the graph hold one batch size: refused."""
        v = to_numpy(c.value)
        axis = x.bdim - (len(x.tshape) - v.ndim)
        if v.ndim > len(x.tshape):
            raise Unsupported(f"a constant of shape {list(v.shape)} of more dims than the value {list(x.tshape)} it broadcasts to")
        if axis < 0 or v.shape[axis] == 1:
            return c
        blocks = np.split(v, self.batch, axis=axis)
        if any(not np.array_equal(b, blocks[0]) for b in blocks[1:]):
            raise Unsupported(f"a constant of shape {list(v.shape)} that differs between the images of the batch (dim {x.bdim})")
        return Const(f"{c.name}.per_image", blocks[0])

    def _binary_moved(self, op: str, x: Act, c: Const, tshape) -> Act:
        """`x op c` for `x` whose batch PyTorch moved to dim `bdim`: `c` broadcast to `x`'s rank
        with that dim moved to the front, as Kiln holds `x`; it must not vary along the batch."""
        v = to_numpy(c.value)
        rank = len(x.tshape)
        if v.ndim > rank:
            raise Unsupported(f"{op.lower()} with a constant of more dims than the value it broadcasts to")
        v = v.reshape((1,) * (rank - v.ndim) + v.shape)
        if v.shape[x.bdim] != 1:
            first = np.take(v, [0], axis=x.bdim)
            if not np.array_equal(v, np.broadcast_to(first, v.shape)):
                raise Unsupported(f"{op.lower()} with a constant that differs along the batch (dim {x.bdim}); export at batch 1")
            v = first
        moved = Const(f"{c.name}.batch_first", np.moveaxis(v, x.bdim, 0))
        return self.node(ops.binary(op), [x, moved], op.lower(), tshape, bdim=x.bdim)


def reshaped_bdim(old, bdim: int, new):
    """Where the batch (PyTorch dim `bdim` of a value of shape `old`) is after a reshape to `new`
    that keeps it a dim of its own, or `None` when the reshape merges or splits it:
    - the dims before it are kept, and so is its size (what follows it is reshaped among itself);
    - or only dims of size 1 come or go (`unsqueeze(0)` of a batch: `torch.stack`)."""
    old, new = tuple(old), tuple(new)
    if len(new) > bdim and new[: bdim + 1] == old[: bdim + 1]:
        return bdim
    keep_old = [i for i, s in enumerate(old) if s != 1]
    keep_new = [i for i, s in enumerate(new) if s != 1]
    if [old[i] for i in keep_old] == [new[i] for i in keep_new] and bdim in keep_old:
        return keep_new[keep_old.index(bdim)]
    return None


def op_family(op) -> str:
    """`Conv`, `Norm.LayerNorm`, ... of an op's serde form, for messages."""
    if isinstance(op, dict) and len(op) == 1:
        (family, body), = op.items()
        if isinstance(body, dict) and len(body) == 1:
            return f"{family}.{next(iter(body))}"
        return family
    return str(op)


def merge_constant_adds(graph: KilnGraph, cat_adds: set) -> None:
    """`(pad(x) + C) + W` with `C` a cat's constants and `W` another constant (ViT's class token,
    then its position embedding) as `pad(x) + (C + W)`: exact, as each element of `pad(x)` or of `C`
    is 0, and one add fewer. The merged constant is named `<W>+<C>`."""
    readers = graph.readers()
    outputs = {i for _, i in graph.outputs}
    for a in sorted(cat_adds):
        node = graph.nodes[a]
        if a in outputs or len(readers[a]) != 1:
            continue
        b = readers[a][0]
        nb = graph.nodes[b]
        if nb["op"] != {"Binary": "Add"} or nb["inputs"][0] != a:
            continue
        w = nb["inputs"][1]
        if "Weight" not in graph.nodes[w]["op"] or len(readers[w]) != 1:
            continue
        c_name = graph.nodes[node["inputs"][1]]["op"]["Weight"]["name"]
        w_name = graph.nodes[w]["op"]["Weight"]["name"]
        merged = graph.weights[w_name] + graph.weights[c_name]
        if merged.shape != graph.weights[c_name].shape:
            continue
        # The weight node of `W` (read only here, and before `b`) becomes the merged constant.
        name = f"{w_name}+{c_name}"
        graph.nodes[w].update(op={"Weight": {"name": name}}, path=name, shape=list(merged.shape))
        del graph.weights[w_name], graph.weight_ids[w_name]
        graph.weights[name], graph.weight_ids[name] = merged, w
        nb["inputs"] = [node["inputs"][0], w]
    graph.compact()


def to_numpy(v) -> np.ndarray:
    """A constant's value as a NumPy array (torch tensors included, without importing torch)."""
    if hasattr(v, "detach"):
        v = v.detach().cpu()
        if str(v.dtype) in ("torch.bfloat16", "torch.float16"):
            v = v.float()
        return v.numpy()
    return np.asarray(v)
