"""Kiln's bundled models, as the `kiln` binary lists them (`kiln models --json`, from
`kiln_models::BUNDLED`, the one list), for the Python tools: each is a dict with `name`,
`input_size`, `outputs`, `family` (`classifier`, `centernet` or `yolo`), `torchvision` (whether
`torchvision.models` has a builder of that name) and `description`.

The binary is the one given (`--kiln`), else `$KILN_BIN`, else the one beside these tools: the
device's `.carry/kiln/kiln` (tools/gpu-build.sh) or this checkout's `target/release/kiln`, else
`kiln` on the PATH. Nothing here needs a GPU, Rust or the kiln sources.
"""

import json
import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
BESIDE = [os.path.join(HERE, "..", "kiln", "kiln"), os.path.join(HERE, "..", "target", "release", "kiln")]


def kiln_exe(explicit=None):
    """The `kiln` binary to ask (see the module's docstring for the order)."""
    for candidate in (explicit, os.environ.get("KILN_BIN"), *BESIDE, shutil.which("kiln")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    if explicit:
        raise SystemExit(f"{explicit}: not an executable kiln binary")
    raise SystemExit("no kiln binary: pass --kiln PATH or set KILN_BIN (build it with `cargo build --release -p kiln-cli`)")


def models(exe=None):
    """The bundled models in `BUNDLED`'s order, as dicts (see the module's docstring)."""
    exe = kiln_exe(exe)
    p = subprocess.run([exe, "models", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"`{exe} models --json` failed ({p.returncode}): {p.stderr.strip()}")
    return json.loads(p.stdout)
