"""Keep what an older torch's torch.save writes, so that the torch-free writer's layout for it is
checked against the real library in every test run (tests/test_torch_save_layouts.py).

    # under the torch to pin (its own environment), from the repository root:
    PYTHONPATH=$PWD python bench/torch_save_layouts.py tests/data/torch_saves [SAVE_DIR ...]

For each tree, torch.save writes `materialize(tree)` with reshard's stand-in pickle module, as
reshard's torch path would: under `skip_data()` where the release has it (2.5), else with every
storage zero-filled (2.4 has no skip_data, so its records carry the CRCs of zeros). The trees:
a few synthetic ones (every dtype the writer knows, shared storages, views, empty tensors, more
than ten storages so that the text order of their keys differs from the order of first use), and
the target files reshard writes for every SAVE_DIR (a real DeepSpeed save) at 1 and 3 ranks.
Files go to OUT/<torch release>/, with index.json naming each file's tree and how torch wrote it.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint
from reshard.formats.deepspeed_files.deepspeed_target import target_files
from reshard.formats.torch_bytes.torch_archive import leaves_in_order, materialize
from reshard.formats.torch_bytes.torch_classes import stand_in_pickle_module
from reshard.formats.torch_bytes.torch_tree import NewTensor
from reshard.topology import Topology

SAFE = classes.safe_globals()


def synthetic_trees() -> dict[str, object]:
    dtypes = ["float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
              "complex64"]
    many = OrderedDict((f"t{i}", NewTensor(("many", i), i % 5, dtypes[i % len(dtypes)])) for i in range(14))
    many["tied"] = NewTensor(("many", 3), 3, dtypes[3])
    many["shaped"] = NewTensor(("shaped", 0), 6, "float32", shape=(2, 3))
    many["grad"] = NewTensor(("grad", 0), 2, "float64", requires_grad=True)
    many["zero_dims"] = NewTensor(("zero", 0), 0, "int64", shape=(2, 0, 3))
    scaler = classes.DynamicLossScaler()
    scaler.__dict__.update(cur_scale=65536.0, cur_iter=3)
    return {
        "many_storages": {"state": many, "scaler": scaler, "stage": classes.ZeroStageEnum(2),
                          "nested": [1, 2.5, "x", None, True, (1, "s", b"\x00\xff"), {"k": [3]}]},
        "one_tensor": NewTensor(("one", 0), 4, "float32"),
        "no_tensors": {"a": [1, "b"], "c": None},
    }


def target_trees(save_dir: Path) -> dict[str, object]:
    source = inspect_checkpoint(save_dir)
    trees = {}
    for m in (1, 3):
        for rank in range(m):
            for target in target_files(source, Topology(dp=m), rank):
                trees[f"{save_dir.parent.name}-m{m}-{target.name}"] = target.tree
    return trees


def save_like_torch(tree, path: Path) -> str:
    obj, _ = materialize(tree)
    module = stand_in_pickle_module(SAFE)
    skip_data = getattr(torch.serialization, "skip_data", None)
    if skip_data is not None:
        with skip_data():
            torch.save(obj, path, pickle_module=module)
        return "skip_data"
    for leaf in leaves_in_order(obj):
        leaf.untyped_storage().fill_(0)
    torch.save(obj, path, pickle_module=module)
    return "zero-filled"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("save_dirs", nargs="*", type=Path, help="DeepSpeed save directories (the tag's parent)")
    args = parser.parse_args(argv)
    release = torch.__version__.split("+")[0]
    out = args.out / release
    out.mkdir(parents=True, exist_ok=True)
    trees = synthetic_trees()
    for save_dir in args.save_dirs:
        trees.update(target_trees(save_dir))
    index = {}
    for name, tree in trees.items():
        file_name = name if name.endswith(".pt") else f"{name}.pt"
        index[file_name] = {"how": save_like_torch(tree, out / file_name)}
    (out / "index.json").write_text(json.dumps({"torch": torch.__version__, "files": index}, indent=1) + "\n")
    print(f"torch {torch.__version__}: {len(index)} files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
