"""The Kiln graph being written: nodes in topological order, inputs, named outputs, weights by
name and the PyTorch class of every module path. Pure Python and NumPy (no torch), so the format
is tested without PyTorch.

The JSON is exactly what Kiln's `Graph` deserialises (src/graph.rs): each node is
`{"op": <the op's serde form>, "inputs": [ids], "shape": [...], "dtype": "F32", "path": "..."}`;
the file is a safetensors file whose `__metadata__` holds it under `kiln.graph` (src/graph_file.rs).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

FORMAT = "kiln-graph"
VERSION = "1"


@dataclass
class Act:
    """An activation of the Kiln graph: node `id`, holding the PyTorch value of shape `tshape`.

    Kiln keeps the batch as dim 0 of every value. A PyTorch value whose dim 0 is not the batch (a
    Swin window batch `[64, 49, C]` made by merging the batch of 1 with the windows) is held
    *lifted*: its Kiln shape is `[1, *tshape]`, so the batch stays in front and every op sees the
    PyTorch dims shifted by one.

    Exported at a batch above 1, a value whose batch PyTorch moved to another dim (ViT's
    `qkv.permute(2, 0, 3, 1, 4)`, `torch.stack(list)`) is held with the batch still first in Kiln:
    `bdim` is the PyTorch dim that holds it, and the Kiln shape is `tshape` with that dim moved to
    the front. (At batch 1 the same values are lifted.)

    A value whose PyTorch dim `bdim` merges the `batch` images with other rows, images outermost
    (window attention's `[B·64, 49, C]`, exported at batch `B`), is lifted too: its Kiln shape is
    `[batch, *tshape]` with dim `bdim` divided by `batch`, so each image's rows stay its own
    (`[B, 64, 49, C]`). At batch 1 that is `[1, *tshape]`, as above.
    """

    id: int
    tshape: tuple
    lifted: bool = False
    bdim: int = 0
    batch: int = 1

    @property
    def kshape(self) -> list:
        t = list(self.tshape)
        if self.lifted:
            if self.batch > 1:
                t[self.bdim] //= self.batch
            return [self.batch] + t
        return t[self.bdim : self.bdim + 1] + t[: self.bdim] + t[self.bdim + 1 :]

    @property
    def offset(self) -> int:
        """Kiln's dim for PyTorch's dim 0 (of a value whose batch is dim 0 or is lifted)."""
        return 1 if self.lifted else 0

    @property
    def moved(self) -> bool:
        """The batch is in PyTorch's dim `bdim`, not 0."""
        return not self.lifted and self.bdim != 0

    def kdim(self, d: int) -> int:
        """Kiln's dim for PyTorch's dim `d`."""
        if self.lifted:
            return d + 1
        if d == self.bdim:
            return 0
        return d + 1 if d < self.bdim else d


@dataclass
class Const:
    """A constant: a parameter or buffer (under its `state_dict` name) or a value computed from
    constants alone while exporting (under `<module path>.<node name>`)."""

    name: str
    value: np.ndarray
    # The 8-bit grid its values lie on (Kiln's `QuantParams`, serde form), for a weight PyTorch
    # dequantised from int8 codes (PT2E): its node is `Op::Weight` with `quant`.
    quant: dict | None = None

    @property
    def tshape(self) -> tuple:
        return tuple(self.value.shape)


@dataclass
class KilnGraph:
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    weights: dict = field(default_factory=dict)
    weight_ids: dict = field(default_factory=dict)
    modules: dict = field(default_factory=dict)

    def push(self, op, inputs: list, shape, path: str) -> int:
        for i in inputs:
            if not 0 <= i < len(self.nodes):
                raise ValueError(f"node at `{path}` reads %{i}, which does not precede it")
        self.nodes.append({"op": op, "inputs": list(inputs), "shape": [int(d) for d in shape], "dtype": "F32", "path": path})
        return len(self.nodes) - 1

    def input(self, name: str, shape) -> int:
        if any(self.nodes[i]["op"]["Input"]["name"] == name for i in self.inputs):
            raise ValueError(f"two inputs are named `{name}`")
        i = self.push({"Input": {"name": name}}, [], shape, name)
        self.inputs.append(i)
        return i

    def weight(self, name: str, value: np.ndarray, quant: dict | None = None) -> int:
        """The weight node of `name` (one per name, as Kiln's `Graph::weight`), with the 8-bit grid
        its values lie on, if any (`Op::Weight::quant`)."""
        value = np.ascontiguousarray(value, dtype=np.float32)
        op = {"Weight": {"name": name, "quant": quant} if quant is not None else {"name": name}}
        if name in self.weight_ids:
            have = self.weights[name]
            if have.shape != value.shape or not np.array_equal(have, value, equal_nan=True):
                raise ValueError(f"two different constants are named `{name}`")
            if self.nodes[self.weight_ids[name]]["op"] != op:
                raise ValueError(f"constant `{name}` is read on two different 8-bit grids")
            return self.weight_ids[name]
        self.weights[name] = value
        i = self.push(op, [], value.shape, name)
        self.weight_ids[name] = i
        return i

    def truncate(self, n: int) -> None:
        """Drops nodes `n..` (and their weights): undoes a conversion that gave up."""
        del self.nodes[n:]
        for name, i in list(self.weight_ids.items()):
            if i >= n:
                del self.weight_ids[name], self.weights[name]

    def mark_output(self, name: str, node: int) -> None:
        if any(n == name for n, _ in self.outputs):
            raise ValueError(f"two outputs are named `{name}`")
        self.outputs.append([name, node])

    def readers(self) -> list:
        out = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for j in n["inputs"]:
                out[j].append(i)
        return out

    def compact(self) -> None:
        """Drops the nodes no output depends on (and their weights), renumbering the rest."""
        live = set(self.inputs) | {i for _, i in self.outputs}
        for i in range(len(self.nodes) - 1, -1, -1):
            if i in live:
                live.update(self.nodes[i]["inputs"])
        new = {}
        nodes = []
        for i, n in enumerate(self.nodes):
            if i in live:
                new[i] = len(nodes)
                nodes.append(dict(n, inputs=[new[j] for j in n["inputs"]]))
        self.nodes = nodes
        self.inputs = [new[i] for i in self.inputs]
        self.outputs = [[name, new[i]] for name, i in self.outputs]
        self.weight_ids = {k: new[i] for k, i in self.weight_ids.items() if i in new}
        self.weights = {k: v for k, v in self.weights.items() if k in self.weight_ids}

    def to_json(self) -> dict:
        g = {"nodes": self.nodes, "inputs": self.inputs, "outputs": self.outputs, "fp32_layers": []}
        if self.modules:
            g["modules"] = dict(sorted(self.modules.items()))
        return g

    def op_counts(self) -> dict:
        """Kiln op kinds and how many nodes of each (inputs and weights left out)."""
        counts: dict = {}
        for n in self.nodes:
            kind = op_name(n["op"])
            if kind not in ("input", "weight"):
                counts[kind] = counts.get(kind, 0) + 1
        return counts


def op_name(op) -> str:
    """A short name for an op's serde form: `Conv`, `Unary.Relu`, `Shape.Reshape`, `Custom.deform_conv2d`."""
    if isinstance(op, str):
        return op
    (family, body), = op.items()
    if family in ("Input", "Weight"):
        return family.lower()
    if family == "Custom":
        return f"Custom.{body['name']}"
    if isinstance(body, str):
        return f"{family}.{body}"
    if isinstance(body, dict) and len(body) == 1 and family not in ("Conv", "Attention", "QkvAttention"):
        return f"{family}.{next(iter(body))}"
    return family


def encode_safetensors(tensors: dict, metadata: dict) -> bytes:
    """A safetensors file: an 8-byte little-endian header length, the JSON header (offsets
    contiguous, in name order, padded with spaces to 8 bytes), then the f32 data."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    chunks, offset = [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def decode_safetensors(data: bytes):
    """(tensors as f32 arrays, metadata) of a safetensors file of f32 tensors."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    metadata = header.pop("__metadata__", {})
    base = 8 + n
    tensors = {}
    for name, info in header.items():
        if info["dtype"] != "F32":
            raise ValueError(f"tensor `{name}` is {info['dtype']}; only F32 is read here")
        start, end = info["data_offsets"]
        tensors[name] = np.frombuffer(data[base + start : base + end], dtype="<f4").reshape(info["shape"])
    return tensors, metadata


def encode_reference(inputs: dict, outputs: dict, metadata: dict | None = None) -> bytes:
    """A reference file for `kiln compare --reference`: every input under `input.<name>` (its
    name in the graph, so any names and several inputs bind), every output under
    `output.<name>`. (Files of older versions hold one input as `input`; Kiln reads both.)"""
    tensors = {f"input.{n}": v for n, v in inputs.items()}
    tensors.update({f"output.{n}": v for n, v in outputs.items()})
    return encode_safetensors(tensors, dict(metadata or {}))


def encode(graph: KilnGraph, extra: dict | None = None) -> bytes:
    """The bytes of a Kiln graph file: the weights under their names, the graph JSON in the metadata."""
    metadata = dict(extra or {})
    metadata.update({"format": FORMAT, "kiln.version": VERSION, "kiln.graph": json.dumps(graph.to_json(), separators=(",", ":"))})
    return encode_safetensors(graph.weights, metadata)


def write(graph: KilnGraph, path, extra: dict | None = None) -> None:
    with open(path, "wb") as f:
        f.write(encode(graph, extra))
