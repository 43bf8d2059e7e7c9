#!/usr/bin/env python3
"""The import cycles of a Rust crate's modules, measured from the code: every `crate::`, `super::`
and `self::` path (in `use` trees and in expressions) of src/**/*.rs is resolved to the file that
defines the item it names, and the strongly connected components of that file graph with more
than one file are printed, largest first.

  python3 tools/import_cycles.py                 the cycles of src/ (test modules left out)
  python3 tools/import_cycles.py -v              ... with each cycle's edges (file -> files it uses)
  python3 tools/import_cycles.py --reexports     ... counting `pub use` re-exports as edges too
  python3 tools/import_cycles.py --tests         ... counting `#[cfg(test)]` code too
  python3 tools/import_cycles.py --pairs         ... and the pairs of files that import each other
  python3 tools/import_cycles.py --src DIR       another crate's source folder

A path is resolved through re-exports: `crate::graph::ConvAttrs`, where graph.rs has
`pub use crate::ops::conv::ConvAttrs`, is an edge to ops/conv.rs, not to graph.rs. By default a
re-export is naming, not use: it is an edge only where the file's own code names it, so a file that
only re-exports (a mod.rs) adds no edge of its own; `--reexports` counts every re-export. Pure Python, no dependencies; a heuristic reader of Rust, not a parser:
macros' `$crate::` paths and `#[path]` attributes are ignored.
"""

import argparse
import os
import re
import sys

ITEM = re.compile(
    r"\b(?:fn|struct|enum|trait|type|const|static|union|mod)\s+([A-Za-z_]\w*)|\bmacro_rules!\s*([A-Za-z_]\w*)"
)
USE = re.compile(r"\b(pub(?:\s*\([^)]*\))?\s+)?use\s+([^;]+);")
PATH = re.compile(r"(?<![\w$:])((?:crate|super|self)(?:\s*::\s*[A-Za-z_]\w*)+)")


def strip(text):
    """`text` with comments, string and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        out.append("\n")
                    i += 1
        elif (c == "r" or text.startswith("br", i)) and re.match(r"b?r#*\"", text[i:]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r"b?r(#*)\"", text[i:])
            end = text.find('"' + m.group(1), i + m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{..}'), else a lifetime or label.
            m = re.match(r"'(\\.[^']*|[^'\\])'", text[i:])
            if m:
                out.append("' '")
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def block_end(text, i):
    """The index after the item starting at `i`: its `;` or its brace-matched body."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c == ";" and depth == 0:
            return i + 1
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def drop_tests(text):
    """`text` without the items marked `#[cfg(test)]`."""
    out, i = [], 0
    for m in re.finditer(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]", text):
        if m.start() < i:
            continue
        out.append(text[i : m.start()])
        i = block_end(text, m.end())
    out.append(text[i:])
    return "".join(out)


def use_tree(tree):
    """The leaves of a `use` tree as (path segments, local name or None for a glob)."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+", "@", tree))  # `a as b` is `a@b`

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for c in s:
            if c == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += c == "{"
            depth -= c == "}"
            cur += c
        if cur:
            parts.append(cur)
        return parts

    def walk(prefix, s):
        if not s:
            return []
        brace = s.find("{")
        if brace >= 0 and s.endswith("}"):
            head = [p for p in s[:brace].split("::") if p]
            leaves = []
            for part in split_top(s[brace + 1 : -1]):
                leaves += walk(prefix + head, part)
            return leaves
        alias = None
        if "@" in s:
            s, alias = s.split("@", 1)
        segs = prefix + [p for p in s.split("::") if p]
        if segs and segs[-1] == "*":
            return [(segs[:-1], None)]
        if segs and segs[-1] == "self":
            segs = segs[:-1]
        return [(segs, alias or (segs[-1] if segs else None))]

    return walk([], tree)


class Crate:
    def __init__(self, src, tests):
        self.src = src
        self.files = {}  # module path (tuple) -> file (relative to src)
        for root, _, names in os.walk(src):
            for name in names:
                if not name.endswith(".rs"):
                    continue
                rel = os.path.relpath(os.path.join(root, name), src)
                parts = rel[:-3].split(os.sep)
                if parts[-1] in ("lib", "main") and len(parts) == 1:
                    parts = []
                elif parts[-1] == "mod":
                    parts = parts[:-1]
                self.files[tuple(parts)] = rel
        self.code, self.defs, self.uses = {}, {}, {}
        for mod, rel in self.files.items():
            with open(os.path.join(src, rel), encoding="utf-8") as f:
                code = strip(f.read())
            if not tests:
                code = drop_tests(code)
            self.code[mod] = code
            self.defs[mod] = {a or b for a, b in ITEM.findall(code)}
            uses = []  # (is pub, absolute segments, local name or None)
            for m in USE.finditer(code):
                for segs, name in use_tree(m.group(2)):
                    absolute = self.absolute(mod, segs)
                    if absolute is not None:
                        uses.append((bool(m.group(1)), absolute, name))
            self.uses[mod] = uses

    def absolute(self, mod, segs):
        """`segs` as a path from the crate root, seen from `mod`; None for another crate's."""
        if not segs:
            return None
        if segs[0] == "crate":
            return list(segs[1:])
        if segs[0] in ("super", "self"):
            base = list(mod)
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    if not base:
                        return None
                    base.pop()
                segs = segs[1:]
            return base + list(segs)
        if tuple(mod) + (segs[0],) in self.files:  # a child module, by a uniform path
            return list(mod) + list(segs)
        return None

    def resolve(self, segs, depth=0):
        """The file defining the item an absolute path names (None: not this crate's)."""
        mod, i = (), 0
        while i < len(segs) and mod + (segs[i],) in self.files:
            mod, i = mod + (segs[i],), i + 1
        if i == len(segs) or depth > 16:
            return self.files[mod]
        name = segs[i]
        if name in self.defs[mod]:
            return self.files[mod]
        for _, target, local in self.uses[mod]:
            if local == name:
                return self.resolve(target + list(segs[i + 1 :]), depth + 1)
        for _, target, local in self.uses[mod]:
            opened = tuple(target)
            if local is None and opened in self.files:
                if name in self.defs[opened] or any(other == name for _, _, other in self.uses[opened]):
                    return self.resolve(target + list(segs[i:]), depth + 1)
        return self.files[mod]

    def edges(self, reexports):
        graph = {rel: set() for rel in self.files.values()}
        for mod, rel in self.files.items():
            targets = []
            body = USE.sub(" ", self.code[mod])
            for public, target, local in self.uses[mod]:
                # A re-export is a use too where the file's own code names it.
                if public and not reexports and not (local and re.search(rf"\b{local}\b", body)):
                    continue
                if local is None:  # a glob: the module it opens
                    m = tuple(target)
                    targets.append(self.files.get(m) or self.resolve(target))
                else:
                    targets.append(self.resolve(target))
            for m in PATH.finditer(body):
                segs = [s.strip() for s in m.group(1).split("::")]
                absolute = self.absolute(mod, segs)
                if absolute is not None:
                    targets.append(self.resolve(absolute))
            graph[rel].update(t for t in targets if t and t != rel)
        return graph


def components(graph):
    """Tarjan's strongly connected components, iteratively."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    ap.add_argument("--reexports", action="store_true", help="count `pub use` re-exports as edges")
    ap.add_argument("--tests", action="store_true", help="count #[cfg(test)] code")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each cycle's edges")
    ap.add_argument("--pairs", action="store_true", help="also list the pairs of files that import each other")
    args = ap.parse_args()
    crate = Crate(os.path.normpath(args.src), args.tests)
    graph = crate.edges(args.reexports)
    cycles = sorted((c for c in components(graph) if len(c) > 1), key=lambda c: (-len(c), c))
    in_cycles = sum(len(c) for c in cycles)
    print(f"{len(graph)} files, {sum(len(e) for e in graph.values())} edges; {len(cycles)} cycle(s) spanning {in_cycles} files")
    for n, comp in enumerate(cycles, 1):
        print(f"cycle {n}: {len(comp)} files: {' '.join(comp)}")
        if args.verbose:
            members = set(comp)
            for f in comp:
                print(f"  {f} -> {' '.join(sorted(graph[f] & members))}")
    if args.pairs:
        pairs = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph[b])
        print(f"{len(pairs)} pair(s) of files importing each other:")
        for a, b in pairs:
            print(f"  {a} <-> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
