"""The PyTorch side: `torch.export` captures the model as an ATen graph, every node is converted
through the op table (`ops.py`) or computed right away when it reads constants only, and the result
is a Kiln graph file. Needs torch."""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field

import torch

from . import graph as kg
from . import ops
from .convert import Builder, Unknown, merge_constant_adds, plan
from .graph import Act, Const
from .ops import Unsupported
from .report import Missing, UnsupportedOpsError, source_line

VERSION = "0.1.0"


class ExportError(Exception):
    """torch.export could not capture the model (data-dependent control flow, unsupported Python)."""


@dataclass
class Result:
    graph: kg.KilnGraph
    inputs: dict  # name -> np.ndarray (the example inputs)
    outputs: dict  # name -> np.ndarray (PyTorch's outputs on them)
    metadata: dict = field(default_factory=dict)


def _named_outputs(value, names=None) -> list:
    """(name, tensor) for each tensor of a model's output: `output` for one tensor, the keys of a
    dict (`out`, `aux`), `output0`, `output1` ... for a tuple or list."""
    flat, _ = torch.utils._pytree.tree_flatten_with_path(value)
    tensors = [(path, v) for path, v in flat if isinstance(v, torch.Tensor)]
    if names is not None:
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} output names given, the model returns {len(tensors)} tensors")
        return list(zip(names, (v for _, v in tensors)))
    if len(tensors) == 1 and not flat[0][0]:
        return [("output", tensors[0][1])]
    out = []
    for i, (path, v) in enumerate(tensors):
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", i)))) for k in path]
        name = ".".join(keys) if keys and not all(k.isdigit() for k in keys) else f"output{i}"
        out.append((name, v))
    return out


def _class_name(cls) -> str:
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


class Converter:
    """Walks one exported program and builds the Kiln graph, collecting what it cannot convert."""

    def __init__(self, ep, model, input_names, custom_ops, whole_modules=True):
        self.ep = ep
        self.b = Builder()
        self.values: dict = {}
        self.missing: list = []
        self.user = ops.custom_table(custom_ops)
        self.has_children = {name for name, m in model.named_modules() if next(m.children(), None) is not None}
        self.root = _class_name(type(model))
        self.input_names = input_names
        self.model = model
        self.whole_modules = whole_modules
        self.b.graph.modules[""] = self.root

    # ---- placeholders

    def _tensor_of(self, spec):
        if spec.target in self.ep.state_dict:
            return self.ep.state_dict[spec.target]
        return self.ep.constants[spec.target]

    def placeholders(self) -> None:
        kinds = torch.export.graph_signature.InputKind
        user = 0
        for spec in self.ep.graph_signature.input_specs:
            name = spec.arg.name
            if spec.kind == kinds.USER_INPUT:
                node = next(n for n in self.ep.graph.nodes if n.name == name)
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    raise ExportError(f"input `{name}` is not a tensor ({type(val).__name__}); Kiln's inputs are tensors")
                if val.dtype != torch.float32:
                    raise ExportError(f"input `{name}` is {val.dtype}; export with float32 inputs")
                kname = self.input_names[user] if self.input_names and user < len(self.input_names) else name
                shape = tuple(int(d) for d in val.shape)
                if user == 0 and shape:
                    self.b.batch = shape[0]
                user += 1
                self.values[name] = Act(self.b.graph.input(kname, shape), shape)
            elif spec.kind in (kinds.PARAMETER, kinds.BUFFER, kinds.CONSTANT_TENSOR):
                self.values[name] = Const(spec.target, self._tensor_of(spec).detach())
            else:
                raise ExportError(f"input `{name}` of kind {spec.kind} is not supported")

    # ---- nodes

    def _scope(self, node):
        stack = node.meta.get("nn_module_stack") or {}
        path, cls = "", self.root
        for p, c in stack.values():
            p = p.replace("L['self'].", "").replace("L__self__.", "")
            if p.startswith("L['self']") or p == "L__self__":
                p = ""
            self.b.graph.modules.setdefault(p, _class_name(c))
            path, cls = p, _class_name(c)
        return path, cls, bool(path) and path not in self.has_children

    def _map(self, a):
        if isinstance(a, torch.fx.Node):
            return self.values[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(self._map(x) for x in a)
        if isinstance(a, dict):
            return {k: self._map(v) for k, v in a.items()}
        return a

    @staticmethod
    def _flat(v):
        if isinstance(v, (list, tuple)):
            for x in v:
                yield from Converter._flat(x)
        elif isinstance(v, dict):
            for x in v.values():
                yield from Converter._flat(x)
        else:
            yield v

    def _fold(self, node, args, kwargs, scope):
        """Runs a node whose inputs are all constants, in PyTorch, once."""
        def real(v):
            if isinstance(v, Const):
                return v.value
            if isinstance(v, (list, tuple)):
                return type(v)(real(x) for x in v)
            return v

        with torch.no_grad():
            out = node.target(*real(args), **{k: real(v) for k, v in kwargs.items()})
        base = f"{scope}.{node.name}" if scope else node.name
        # A weight dequantised from its codes (PT2E) keeps the grid it lies on, and is named after
        # the module that reads it as Kiln names a weight folded onto its grid
        # (`layer1.0.conv1.weight.int8`; PT2E's codes are `_frozen_param<n>`).
        grid = ops.weight_grid(str(node.target), self._named_args(node, args, kwargs)) if hasattr(node.target, "_schema") else None
        if grid is not None and len(node.users) == 1:
            reader = self._scope(next(iter(node.users)))[0]
            base = f"{reader}.weight.{grid['format'].lower()}" if reader else base

        def wrap(v, i=None):
            if isinstance(v, torch.Tensor):
                return Const(base if i is None else f"{base}.{i}", v.detach(), grid)
            if isinstance(v, (list, tuple)):
                return tuple(wrap(x, j) for j, x in enumerate(v))
            return v

        return wrap(out)

    @staticmethod
    def _named_args(node, args, kwargs) -> dict:
        schema = node.target._schema
        named = {}
        for i, arg in enumerate(schema.arguments):
            if i < len(args) and not arg.kwarg_only:
                named[arg.name] = args[i]
            elif arg.name in kwargs:
                named[arg.name] = kwargs[arg.name]
            elif arg.has_default_value():
                named[arg.name] = arg.default_value
            else:
                named[arg.name] = None
        for k, v in named.items():
            if isinstance(v, torch.dtype):
                named[k] = str(v).replace("torch.", "")
        return named

    @staticmethod
    def _out_shape(node):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return tuple(int(d) for d in val.shape)
        if isinstance(val, (list, tuple)):
            for v in val:
                if isinstance(v, torch.Tensor):
                    return tuple(int(d) for d in v.shape)
        return ()

    def _unknown(self, node):
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            return tuple(Unknown(tuple(v.shape)) if isinstance(v, torch.Tensor) else None for v in val)
        return Unknown(tuple(val.shape) if isinstance(val, torch.Tensor) else ())

    def call(self, node) -> None:
        if node.target is operator.getitem:
            v = self.values[node.args[0].name]
            item = v[node.args[1]] if not isinstance(v, Unknown) else v
            self.values[node.name] = item() if callable(item) else item
            return
        scope, cls, leaf = self._scope(node)
        args, kwargs = self._map(node.args), self._map(node.kwargs)
        flat = list(self._flat((args, kwargs)))
        name = str(node.target)
        conv = ops.find(name, self.user)
        step = plan(flat, conv, hasattr(node.target, "_schema"))
        if step == "fold":
            try:
                self.values[node.name] = self._fold(node, args, kwargs, scope)
            except Exception as e:  # noqa: BLE001 -- PyTorch refused the constants: reported with the node
                self.missing.append(Missing(name, scope, cls, source_line(node.meta.get("stack_trace")),
                                            f"computing it from constants failed: {type(e).__name__}: {e}"))
                self.values[node.name] = self._unknown(node)
            return
        if step == "skip":
            self.values[node.name] = self._unknown(node)
            return
        try:
            if step == "missing":
                raise Unsupported("Kiln has no such op")
            self.b.begin(name, node.name, scope, leaf, self._out_shape(node))
            self.values[node.name] = conv(self.b, self._named_args(node, args, kwargs))
        except Exception as e:  # noqa: BLE001 -- a converter's failure is a line of the report, never a traceback
            reason = str(e) if isinstance(e, Unsupported) else f"the converter failed: {type(e).__name__}: {e}"
            self.missing.append(Missing(name, scope, cls, source_line(node.meta.get("stack_trace")), reason))
            self.values[node.name] = self._unknown(node)

    def outputs(self, names) -> None:
        out_node = next(n for n in self.ep.graph.nodes if n.op == "output")
        kinds = torch.export.graph_signature.OutputKind
        specs = [s for s in self.ep.graph_signature.output_specs if s.kind == kinds.USER_OUTPUT]
        for spec, name in zip(specs, names):
            v = self.values.get(spec.arg.name)
            if isinstance(v, Unknown):
                continue
            if not isinstance(v, Act):
                self.missing.append(Missing("output", "", self.root, None, f"output `{name}` does not depend on the input"))
                continue
            self.b.begin("output", out_node.name, "", False, v.tshape)
            try:
                v = self.b.unlift(v)
            except Unsupported as e:
                self.missing.append(Missing("output", "", self.root, None, f"output `{name}`: {e}"))
                continue
            self.b.graph.mark_output(name, v.id)

    # ---- whole modules (ops.MODULES)

    def _module_calls(self):
        """First node of each call of a module class with a converter → (path, class, the call's nodes)."""
        calls, current = {}, None
        for node in self.ep.graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            hit = next(((k, p, _class_name(c)) for k, (p, c) in stack.items() if _class_name(c) in ops.MODULES), None)
            if node.op != "call_function" or hit is None:
                current = None
                continue
            if current is not None and current[0] == hit[0]:
                calls[current[1]][2].append(node)
                continue
            current = (hit[0], node.name)
            calls[node.name] = (hit[1], hit[2], [node])
        return calls

    def module_call(self, path, cls, nodes) -> bool:
        """Converts one call of a module as a whole; False to convert it op by op."""
        inside = {n.name for n in nodes}
        ext = []
        for n in nodes:
            for a in n.all_input_nodes:
                v = self.values.get(a.name)
                if a.name not in inside and isinstance(v, Act) and v not in ext:
                    ext.append(v)
        outs = [n for n in nodes if any(u.name not in inside for u in n.users)]
        if len(outs) != 1 or any(isinstance(v, Unknown) for v in ext):
            return False
        mod = self.model.get_submodule(path)
        attrs = {k: getattr(mod, k, None) for k in ("num_heads", "embed_dim", "batch_first", "add_zero_attn", "normalized_shape", "eps")}
        attrs["qkv_same_embed_dim"] = getattr(mod, "_qkv_same_embed_dim", True)
        attrs.update({k: getattr(mod, k) for k in ("window_size", "shift_size") if hasattr(mod, k)})
        if hasattr(mod, "get_relative_position_bias"):
            with torch.no_grad():
                attrs["relative_position_bias"] = mod.get_relative_position_bias().detach().float().numpy()
        if isinstance(getattr(mod, "norm", None), torch.nn.LayerNorm):
            attrs["norm_eps"] = mod.norm.eps
        attrs["bias_k"] = getattr(mod, "bias_k", None) is not None
        prefix = f"{path}." if path else ""
        params = {n: Const(prefix + n, p.detach()) for n, p in mod.named_parameters()}
        for n in nodes:
            self._scope(n)
        self.b.begin(cls, nodes[0].name, path, path not in self.has_children, self._out_shape(outs[0]))
        try:
            values = ops.MODULES[cls](self.b, attrs, ext, params)
        except Exception:  # noqa: BLE001 -- Unsupported or not, the module is then converted op by op
            return False
        self.values[outs[0].name] = values[0]
        for n in nodes:
            self.values.setdefault(n.name, Unknown(()))
        return True

    def run(self, output_names):
        self.placeholders()
        calls = self._module_calls() if self.whole_modules else {}
        skip = set()
        for node in self.ep.graph.nodes:
            if node.name in skip:
                continue
            if node.name in calls:
                path, cls, nodes = calls[node.name]
                mark = len(self.b.graph.nodes)
                if self.module_call(path, cls, nodes):
                    skip.update(n.name for n in nodes)
                    continue
                self.b.graph.truncate(mark)
            if node.op == "call_function":
                self.call(node)
            elif node.op not in ("placeholder", "output"):
                self.missing.append(Missing(node.op, "", self.root, None, f"an FX `{node.op}` node"))
        self.outputs(output_names)
        merge_constant_adds(self.b.graph, self.b.cat_constant_adds)
        return self.b.graph


def _decompositions(missing) -> dict:
    """PyTorch's own decompositions of the ops in `missing` that have one (tried once more)."""
    table = torch.export.default_decompositions()
    found = {}
    for m in missing:
        for op in list(table.keys()):
            if str(op) == m.op:
                found[op] = table[op]
    return found


def _fake_quant_modules(model) -> list:
    """(path, module) of each fake-quant module (`torch.ao.quantization.FakeQuantize` and its
    kin, torchao's too: anything with their buffers and flags)."""
    keys = ("fake_quant_enabled", "observer_enabled", "scale", "zero_point", "is_per_channel", "activation_post_process")
    return [(p, m) for p, m in model.named_modules() if all(hasattr(m, k) for k in keys)]


@contextlib.contextmanager
def _exportable_fake_quant(model):
    """Fake-quant modules traced as the fake-quantiser they apply at inference.

    Their `forward` branches on their `observer_enabled` / `fake_quant_enabled` buffers, which
    `torch.export` cannot follow (a data-dependent guard); the flags are read here instead, once:
    a module with its fake-quant off is the identity, one with it on is
    `torch.fake_quantize_per_tensor_affine` / `..._per_channel_affine` of its `scale` and
    `zero_point` buffers (what `FusedMovingAvgObsFakeQuantize` computes with its observer off). A
    module whose observer is still on is refused: its scales would change with every input."""
    patched = []
    try:
        for path, fq in _fake_quant_modules(model):
            if int(fq.observer_enabled[0]) == 1:
                raise ExportError(
                    f"fake-quant module `{path}` ({_class_name(type(fq))}) still has its observer on, so its scales change with "
                    "every input; call `model.apply(disable_observer)` (torch.ao.quantization's, or torchao.quantization.pt2e's) before exporting"
                )
            on = int(fq.fake_quant_enabled[0]) == 1
            obs = fq.activation_post_process
            qmin, qmax = int(getattr(obs, "quant_min", fq.quant_min)), int(getattr(obs, "quant_max", fq.quant_max))

            def forward(x, fq=fq, on=on, qmin=qmin, qmax=qmax):
                if not on:
                    return x
                if fq.is_per_channel:
                    return torch.fake_quantize_per_channel_affine(x, fq.scale, fq.zero_point, fq.ch_axis, qmin, qmax)
                return torch.fake_quantize_per_tensor_affine(x, fq.scale, fq.zero_point, qmin, qmax)

            fq.forward = forward
            patched.append(fq)
        yield
    finally:
        for fq in patched:
            del fq.forward


def _eval(model):
    """`model.eval()`; a model `torch.export` made (PT2E's) refuses train/eval switches and needs none."""
    try:
        return model.eval()
    except NotImplementedError:
        return model


def export(model, example_inputs, path=None, *, input_names=None, output_names=None, custom_ops=None, strict=False,
           reference=None, metadata=None, model_name=None, whole_modules=True) -> Result:
    """Exports `model` (an `nn.Module`) called on `example_inputs` to a Kiln graph file at `path`.

    - `input_names`, `output_names`: Kiln's names for the inputs and outputs (default: the forward
      arguments' names; `output`, the keys of a returned dict, or `output0`, `output1`, ...).
    - `custom_ops`: `{op: kiln custom op}` for ops Kiln lacks (`{"mylib::swish": "swish"}`), see
      `ops.CustomOp`; `torchvision::deform_conv2d` maps to the kiln-deform-conv plugin by itself.
    - `reference`: also write PyTorch's outputs for `kiln compare --reference` (`input.<name>` per
      input, `output.<name>` per output).
    - `whole_modules=False`: convert `nn.MultiheadAttention`, Swin's window attention and the like
      op by op too (`ops.MODULES` converts them whole by default).

    Raises `UnsupportedOpsError` listing every node without a Kiln op, before writing anything.
    The graph runs at any batch, whatever the example batch: the batch may move to another dim
    and back (`torch.stack(list).sum(0)`, ViT's `qkv.permute(2, 0, 3, 1, 4)`) or merge with other
    rows, images outermost (window attention's `[B·64, 49, C]`), and constants expanded to the
    batch (a class token, a window mask) are read per image. An op across the images is reported.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    model = _eval(model)
    model_name = model_name or type(model).__name__
    try:
        with torch.no_grad():
            eager = model(*example_inputs)
        named = _named_outputs(eager, output_names)
    except Exception as e:  # noqa: BLE001 -- the model itself failed on the example inputs
        raise ExportError(f"{model_name} failed on the example inputs: {type(e).__name__}: {e}") from e
    try:
        with _exportable_fake_quant(model):
            ep = torch.export.export(model, example_inputs, strict=strict)
    except ExportError:
        raise
    except Exception as e:  # torch raises many types here; the message is what helps
        raise ExportError(
            f"torch.export could not capture {model_name}: {type(e).__name__}: {e}\n"
            "Kiln imports what torch.export captures: no data-dependent control flow or shapes (docs/IMPORT.md, \"Limits\")."
        ) from e
    ep = ep.run_decompositions({})
    for attempt in range(3):
        conv = Converter(ep, model, input_names, custom_ops, whole_modules)
        try:
            graph = conv.run([n for n, _ in named])
        except (ExportError, UnsupportedOpsError):
            raise
        except Exception as e:  # noqa: BLE001 -- no Python exception escapes the exporter unexplained
            raise ExportError(f"converting {model_name} failed outside any one node: {type(e).__name__}: {e}") from e
        if not conv.missing:
            break
        table = _decompositions(conv.missing) if attempt < 2 else {}
        if not table:
            raise UnsupportedOpsError(conv.missing, model_name)
        ep = ep.run_decompositions(table)
    in_names = [graph.nodes[i]["op"]["Input"]["name"] for i in graph.inputs]
    inputs = {n: x.detach().float().numpy() for n, x in zip(in_names, example_inputs)}
    outputs = {n: v.detach().float().numpy() for n, v in named}
    meta = {
        "kiln.tool": f"kiln-torch {VERSION}",
        "model": model_name,
        "torch": torch.__version__,
        "input_shape": ",".join(f"{n}:" + "x".join(str(d) for d in x.shape) for n, x in inputs.items()),
    }
    meta.update(metadata or {})
    result = Result(graph, inputs, outputs, meta)
    if path is not None:
        kg.write(graph, path, meta)
    if reference is not None:
        write_reference(result, reference)
    return result


def write_reference(result: Result, path) -> None:
    """PyTorch's outputs for `kiln compare --reference`, see `graph.encode_reference`."""
    meta = {k: result.metadata[k] for k in ("model", "kiln.tool", "weights") if k in result.metadata}
    with open(path, "wb") as f:
        f.write(kg.encode_reference(result.inputs, result.outputs, meta))


def load_weights(model, path, strict=True) -> None:
    """Loads a safetensors `state_dict` into `model` (`--weights`)."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    result = model.load_state_dict(state, strict=strict)
    if strict is False and (result.missing_keys or result.unexpected_keys):
        print(f"kiln-torch: --weights {path}: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")

