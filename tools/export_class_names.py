#!/usr/bin/env python3
"""Writes the class names that kiln-vision ships (vision/data/), one name a line, line i = class i:
  imagenet_classes.txt   torchvision's `MobileNet_V2_Weights.IMAGENET1K_V1.meta["categories"]`
                         (the 1000 ImageNet-1k names every torchvision classifier's weights share)
  coco_classes.txt       Ultralytics' 80 COCO names (`names:` of ultralytics/cfg/datasets/coco.yaml)

    pip download ultralytics --no-deps -d /tmp/ul && unzip /tmp/ul/ultralytics-*.whl 'ultralytics/cfg/*' -d /tmp/ul
    python3 tools/export_class_names.py --coco-yaml /tmp/ul/ultralytics/cfg/datasets/coco.yaml
"""

import argparse
import os
import re

from torchvision.models import MobileNet_V2_Weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "vision", "data")


def coco_names(path):
    """The `names:` mapping of an Ultralytics dataset YAML (`  0: person` lines), in index order."""
    names, inside = {}, False
    for line in open(path, encoding="utf-8"):
        if line.startswith("names:"):
            inside = True
            continue
        m = re.match(r"^\s+(\d+):\s*(.+?)\s*$", line) if inside else None
        if m:
            names[int(m.group(1))] = m.group(2).strip("'\"")
        elif inside and line.strip() and not line.startswith(" "):
            break
    assert sorted(names) == list(range(len(names))), "class ids are not 0..n"
    return [names[i] for i in range(len(names))]


def write(name, names):
    assert all("\n" not in n for n in names)
    with open(os.path.join(DATA, name), "w", encoding="utf-8") as f:
        f.write("\n".join(names) + "\n")
    print(f"{name}: {len(names)} names")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco-yaml", required=True)
    args = ap.parse_args()
    os.makedirs(DATA, exist_ok=True)
    imagenet = MobileNet_V2_Weights.IMAGENET1K_V1.meta["categories"]
    assert len(imagenet) == 1000
    write("imagenet_classes.txt", imagenet)
    coco = coco_names(args.coco_yaml)
    assert len(coco) == 80
    write("coco_classes.txt", coco)


if __name__ == "__main__":
    main()
