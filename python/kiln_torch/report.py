"""The report of nodes Kiln cannot import, all at once, with the way to add each op. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

DOCS = "docs/IMPORT.md, \"Import a model with an op Kiln lacks\""


@dataclass
class Missing:
    """A node of the exported graph with no Kiln op."""

    op: str  # the ATen op as torch.export names it: `aten.erf.default`, `mylib.swish.default`
    path: str  # the module path it was called in (`blocks.0.act`; `` for the model itself)
    module: str  # that module's class (`mymodel.ErfGelu`)
    source: str | None  # `model.py:12 in forward: y = torch.erf(x)`, when PyTorch recorded it
    reason: str  # why: no Kiln op, or what about this call Kiln cannot express


class UnsupportedOpsError(Exception):
    """Raised by `export` before anything is written; `str()` is the report."""

    def __init__(self, missing: list, model: str = "the model"):
        self.missing = list(missing)
        self.model = model
        super().__init__(format_report(self.missing, model))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def custom_op_name(op: str) -> str:
    """The Kiln custom op name suggested for an ATen op: `aten.erf.default` → `erf`."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


def format_report(missing: list, model: str = "the model") -> str:
    """Every node without a Kiln op, grouped by op (in order of first appearance), then how to add
    one as a Kiln custom op."""
    by_op: dict = {}
    for m in missing:
        by_op.setdefault(m.op, []).append(m)
    lines = [
        f"kiln-torch: {_plural(len(missing), 'node')} of {model} cannot be imported "
        f"({_plural(len(by_op), 'op')}); nothing was written.",
        "",
    ]
    for op, nodes in by_op.items():
        lines.append(f"  {op}  ({_plural(len(nodes), 'node')})")
        for m in nodes:
            where = m.path or "<model>"
            cls = f" ({m.module})" if m.module else ""
            lines.append(f"    at {where}{cls}: {m.reason}")
            if m.source:
                lines.append(f"      {m.source}")
    lines += [
        "",
        "To import an op Kiln lacks, register it as a Kiln custom op and map it when exporting:",
        "  1. In Rust, submit a `kiln::plugin::CustomOp` (name, shape rule, CPU reference) with",
        "     `kiln::inventory::submit!`, and its GPU converter with `kiln::register_converter!`",
        "     (plugins/deform-conv is a complete example).",
        "  2. Map the op to it when exporting; its tensors become the node's inputs, its numbers attributes:",
    ]
    table = ", ".join(f'"{op}": "{custom_op_name(op)}"' for op in by_op)
    lines.append(f"       kiln_torch.export(model, inputs, path, custom_ops={{{table}}})")
    flags = " ".join(f"--custom-op {op}={custom_op_name(op)}" for op in by_op)
    lines.append(f"     or: kiln-torch export ... {flags}")
    lines.append("  3. A Python function that is not one op: wrap it with `torch.library.custom_op(\"mylib::name\", ...)`")
    lines.append("     so that torch.export keeps it as one node, and map `mylib::name`.")
    lines.append(f"See {DOCS}.")
    return "\n".join(lines)


def source_line(stack_trace: str | None, skip=("/torch/",)) -> str | None:
    """`file:line in fn: code` of the innermost frame outside PyTorch itself, from a node's
    `stack_trace` (the frames `File "...", line N, in fn` each followed by its code line)."""
    if not stack_trace:
        return None
    frames = []
    lines = stack_trace.strip("\n").split("\n")
    for i, line in enumerate(lines):
        s = line.strip()
        if not s.startswith('File "'):
            continue
        try:
            file = s.split('"')[1]
            rest = s.split('"', 2)[2]
            lineno = rest.split("line ")[1].split(",")[0].strip()
            fn = rest.split(" in ", 1)[1].strip() if " in " in rest else "?"
        except IndexError:
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith('File "') else ""
        frames.append((file, lineno, fn, code))
    if not frames:
        return None
    outside = [f for f in frames if not any(s in f[0].replace("\\", "/") for s in skip)]
    file, lineno, fn, code = (outside or frames)[-1]
    short = "/".join(file.replace("\\", "/").split("/")[-2:])
    return f"{short}:{lineno} in {fn}: {code}" if code else f"{short}:{lineno} in {fn}"
