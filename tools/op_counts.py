"""Op counts of optimised graphs, side by side: what the engine builder lowers (`kiln inspect
--no-engine`'s "optimised graph", the output of `kiln::engine::optimize`) for a bundled model and
its import (docs/PERFORMANCE.md, step 12).

The last row is the number of layout copies the builder will plan (`kiln inspect`'s list).
A kind is the op's name with its fused parts (`linear +bias +residual`, `qkv_attention +bias`).
`flatten` counts as `reshape` (both lower to the same reshape, `ops::shape::gpu_reshape`) unless
`--raw`. `--diff` also prints the ops that differ, in graph order (a unified diff of the op
descriptions and shapes).

    python3 tools/op_counts.py --kiln target/release/kiln vit_b_16 /tmp/imported/vit_b_16.kiln.safetensors
    python3 tools/op_counts.py --diff swin_t /tmp/imported/swin_t.kiln.safetensors
"""

from __future__ import annotations

import argparse
import collections
import difflib
import re
import subprocess
import sys

ROW = re.compile(r"%\d+\s+(.*?)\s+\[([\d, ]*)\]\s+(\S+)")


COPIES = re.compile(r"^(\d+) layout copies planned", re.M)


def optimised(kiln: str, model: str) -> tuple[list[tuple[str, str]], int | None]:
    """(description, shape) of each node of the optimised graph, in order, and the number of
    layout copies `kiln inspect` says the builder will plan."""
    p = subprocess.run([kiln, "inspect", model, "--no-engine"], capture_output=True, text=True)
    text = p.stdout
    if "== optimised graph" not in text:
        sys.exit(f"op_counts: `kiln inspect {model} --no-engine` printed no optimised graph:\n{p.stderr[-2000:]}")
    rows = []
    for line in text.split("== optimised graph", 1)[1].splitlines()[1:]:
        if line.startswith("=="):
            break
        m = ROW.match(line)
        if m:
            rows.append((m.group(1), m.group(2)))
    copies = COPIES.search(text)
    return rows, int(copies.group(1)) if copies else None


def kind(desc: str, raw: bool) -> str:
    words = desc.split()
    name = words[0]
    if name == "flatten" and not raw:
        name = "reshape"
    return " ".join([name] + [w for w in words[1:] if w.startswith("+")])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="bundled model names or graph files; the first is the baseline")
    p.add_argument("--kiln", default="target/release/kiln")
    p.add_argument("--raw", action="store_true", help="count flatten apart from reshape")
    p.add_argument("--diff", action="store_true", help="also print the ops that differ from the first model, in order")
    a = p.parse_args()
    seen = {m: optimised(a.kiln, m) for m in a.models}
    graphs = {m: rows for m, (rows, _) in seen.items()}
    counts = {m: collections.Counter(kind(d, a.raw) for d, _ in rows) for m, rows in graphs.items()}
    kinds = sorted(set().union(*counts.values()))
    names = [m.rsplit("/", 1)[-1] for m in a.models]
    print("| op | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for k in kinds:
        vals = [counts[m][k] for m in a.models]
        mark = "" if len(set(vals)) == 1 else " **≠**"
        print(f"| {k}{mark} | " + " | ".join(str(v) for v in vals) + " |")
    print("| **all** | " + " | ".join(str(len(graphs[m])) for m in a.models) + " |")
    print("| layout copies planned | " + " | ".join(str(seen[m][1]) for m in a.models) + " |")
    if a.diff:
        base = [f"{d} [{s}]" for d, s in graphs[a.models[0]]]
        for m in a.models[1:]:
            other = [f"{d} [{s}]" for d, s in graphs[m]]
            for line in difflib.unified_diff(base, other, a.models[0], m, n=1, lineterm=""):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
