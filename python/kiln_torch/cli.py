"""`kiln-torch export MODULE:FUNCTION --input NAME:DIMS [-o FILE]`: the command line."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import builders

EXAMPLES = """examples:
  kiln-torch export torchvision.models:resnet50 --input input:1x3x224x224 -o rn50.kiln.safetensors
  kiln-torch export torchvision.models.segmentation:fcn_resnet50 --input input:1x3x520x520 --kwargs aux_loss=False
  kiln-torch export mynet:build --weights mynet.safetensors --input input:1x3x64x64 --reference mynet.reference.safetensors
  kiln-torch export mylib.models:Net --input x:1x16 --custom-op mylib::swish=swish
"""


def parse_input(text: str):
    """`name:1x3x224x224` (or `1x3x224x224`, named `input`) → (name, [1, 3, 224, 224])."""
    name, _, dims = text.rpartition(":")
    try:
        shape = [int(d) for d in dims.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input {text!r}: expected NAME:DxDxD, e.g. input:1x3x224x224") from None
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"--input {text!r}: dims must be positive")
    return (name or "input", shape)


def parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def parse_kwargs(items):
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"kiln-torch: --kwargs {item!r}: expected KEY=VALUE")
        out[key] = parse_value(value)
    return out


def load_model(spec: str, kwargs: dict):
    """`module:attr` → the `nn.Module` it names or builds (a class or function is called with
    `kwargs`, and every weight argument it takes, `weights`, `weights_backbone`, `pretrained`,
    `encoder_weights`..., set to download nothing unless given: `builders.build`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise SystemExit(f"kiln-torch: model {spec!r}: expected MODULE:FUNCTION, e.g. torchvision.models:resnet50")
    sys.path.insert(0, ".")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    import torch

    if isinstance(obj, torch.nn.Module):
        return obj
    model = builders.build(obj, kwargs, module_name, what=spec)
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"kiln-torch: {spec} returned a {type(model).__name__}, not an nn.Module")
    return model


def weights_metadata(weights, seed: int) -> dict:
    """The graph file's metadata about its weights: the `--weights` file, or PyTorch's random
    initialisation, marked `kiln.random_weights` so that `kiln run` warns its answers are
    meaningless."""
    if weights:
        return {"weights": str(weights)}
    return {"weights": f"random (torch init, seed {seed})", "kiln.random_weights": "true"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kiln-torch", description=__doc__, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="export a model to a Kiln graph file", epilog=EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ex.add_argument("model", help="MODULE:FUNCTION (or MODULE:Class, or MODULE:instance) building the nn.Module")
    ex.add_argument("--input", action="append", type=parse_input, required=True, metavar="NAME:DIMS",
                    help="an input's name and shape, e.g. input:1x3x224x224 (repeat for several inputs)")
    ex.add_argument("-o", "--output", help="the graph file (default: <function>.kiln.safetensors)")
    ex.add_argument("--weights", help="a safetensors state_dict to load into the model first")
    ex.add_argument("--kwargs", nargs="*", metavar="KEY=VALUE", help="arguments of the model's builder")
    ex.add_argument("--output-name", action="append", metavar="NAME", help="names of the outputs, in order")
    ex.add_argument("--custom-op", action="append", default=[], metavar="OP=KILN_OP",
                    help="map a PyTorch op to a registered Kiln custom op, e.g. mylib::swish=swish")
    ex.add_argument("--reference", metavar="FILE", help="also write the input and PyTorch's outputs (kiln compare --reference)")
    ex.add_argument("--seed", type=int, default=0, help="seed of the random input and of torch's initialisation")
    args = parser.parse_args(argv)

    import torch

    from . import frontend
    from .report import UnsupportedOpsError

    torch.manual_seed(args.seed)
    try:
        model = load_model(args.model, parse_kwargs(args.kwargs))
    except builders.DownloadError as e:
        print(f"kiln-torch: {e}", file=sys.stderr)
        return 1
    if args.weights:
        frontend.load_weights(model, args.weights)
    gen = torch.Generator().manual_seed(args.seed)
    inputs = tuple(torch.rand(shape, generator=gen) * 2 - 1 for _, shape in args.input)
    custom = {}
    for item in args.custom_op:
        op, sep, kiln = item.partition("=")
        if not sep:
            raise SystemExit(f"kiln-torch: --custom-op {item!r}: expected OP=KILN_OP")
        custom[op] = kiln
    name = args.model.partition(":")[2]
    out = args.output or f"{name}.kiln.safetensors"
    try:
        result = frontend.export(model, inputs, out, input_names=[n for n, _ in args.input], output_names=args.output_name,
                                 custom_ops=custom, reference=args.reference, model_name=name,
                                 metadata=weights_metadata(args.weights, args.seed))
    except UnsupportedOpsError as e:
        print(e, file=sys.stderr)
        return 2
    except frontend.ExportError as e:
        print(f"kiln-torch: {e}", file=sys.stderr)
        return 1
    g = result.graph
    n_ops = sum(g.op_counts().values())
    outputs = ", ".join(f"{n} {list(v.shape)}" for n, v in result.outputs.items())
    print(f"wrote {out}: {name} ({n_ops} ops, {len(g.weights)} weights; outputs {outputs})")
    if args.reference:
        print(f"wrote {args.reference}: check with `kiln compare {out} --reference {args.reference} --cpu`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
