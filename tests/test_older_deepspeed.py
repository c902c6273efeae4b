"""Checkpoints of an older DeepSpeed (0.16.9): trained and loaded by it, resharded by this environment.

    python -m pytest -q tests/test_older_deepspeed.py       # builds the 0.16.9 environment once (cached)

The environment (reshard_proof.deepspeed_venv) is cached under ~/.cache/reshard/compat (or
$RESHARD_COMPAT_CACHE), keyed by the DeepSpeed release and this torch: the first session builds
it (about a minute plus DeepSpeed's CPU op compile), later ones reuse it. DeepSpeed 0.16.9 runs the
proof harness's own train and check_load; reshard runs here, under DeepSpeed 0.19.8's environment,
without importing either. What differs from 0.19.8: the model states pickle a `set`
(`sparse_tensor_module_names`, written as the global `__builtin__.set`), the save directory holds
zero_to_fp32.py only, and the optimizer links its fragments lazily after a load
(engine_state calls `_lazy_init_hp_params_optimizer_state` before reading).
"""
from __future__ import annotations

import json
import re

import pytest
from test_torch_free_archive import SAFE, _same_skeleton_as_torch, _same_tree_as_torch
from trained import reshard_cli

from reshard.formats.torch_bytes.torch_archive import load_portable
from reshard_proof.launch import run_torchrun, train_checkpoints

OLDER = "0.16.9"
VARIANTS = ("z2_fp32", "z3_fp32")


@pytest.fixture(scope="session")
def older_deepspeed(tmp_path_factory):
    """variant -> (save_dir, truth), trained on 2 ranks with DeepSpeed 0.16.9, all in one launch (a
    fresh engine each, reshard_proof.train --also: 0.16.9 writes the files a launch of its own
    writes, byte for byte, as 0.19.8 does in tests/test_trained_together.py); and the environment."""
    from reshard_proof.deepspeed_venv import deepspeed_venv
    venv = deepspeed_venv(OLDER)
    root = tmp_path_factory.mktemp(f"deepspeed-{OLDER}")
    trained = {variant: (root / variant / "ckpt", root / variant / "truth.pt") for variant in VARIANTS}
    train_checkpoints(2, [(variant, *paths) for variant, paths in trained.items()], python=venv.python,
                      env=venv.env())
    return venv, trained


def _files(save_dir):
    tag_dir = save_dir / (save_dir / "latest").read_text()
    return {path.name: load_portable(path, SAFE) for path in sorted(tag_dir.glob("*.pt"))}


def _pickle_ops(path, marker: str, count: int) -> list[str]:
    """`count` pickle opcodes (with arguments) of a torch.save file from the one naming `marker` on."""
    import io
    import pickletools
    import zipfile
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(name for name in archive.namelist() if name.endswith("/data.pkl")))
    listing = io.StringIO()
    pickletools.dis(data, listing)
    ops = [line.split(":", 1)[1] for line in listing.getvalue().splitlines() if ":" in line]
    start = next(i for i, op in enumerate(ops) if marker in op)
    return ops[start:start + count]


def _metadata(tree: dict) -> dict:
    """What must stay the source's: the saving release and the key sets of the top two levels."""
    nested = {key: sorted(value) for key, value in tree.items() if isinstance(value, dict) and key != "module"}
    versions = [tree.get("ds_version"), (tree.get("optimizer_state_dict") or {}).get("ds_version")]
    return {"keys": sorted(tree), "nested": nested, "ds_version": [v for v in versions if v is not None]}


@pytest.mark.e2e
def test_older_checkpoints_read_without_torch_and_rewrite_like_torch(older_deepspeed, tmp_path):
    """Every 0.16.9 file reads to torch's own tree without torch (the `set` included), and every
    target file reshard writes for it is torch's skeleton, byte for byte."""
    from reshard.formats.deepspeed_files.deepspeed_inspect import inspect_checkpoint
    from reshard.formats.deepspeed_files.deepspeed_target import target_files
    from reshard.formats.torch_bytes.torch_archive import torch_fallbacks
    from reshard.topology import Topology

    _, trained = older_deepspeed
    for variant, (save_dir, _) in trained.items():
        tag_dir = save_dir / (save_dir / "latest").read_text()
        for path in sorted(tag_dir.glob("*.pt")):
            _same_tree_as_torch(path)
        before = len(torch_fallbacks)
        source = inspect_checkpoint(save_dir)
        assert torch_fallbacks[before:] == [], variant
        for rank in range(3):
            for target in target_files(source, Topology(dp=3), rank):
                _same_skeleton_as_torch(target.tree, tmp_path / variant, target.name)
    assert isinstance(_files(trained["z2_fp32"][0])["mp_rank_00_model_states.pt"]["sparse_tensor_module_names"], set)


@pytest.mark.e2e
def test_older_checkpoint_resharded_here_loads_with_its_own_deepspeed(older_deepspeed, tmp_path):
    """ZeRO-2 and ZeRO-3 fp32 from 0.16.9 at 2 ranks, resharded to 3 torch-free; 0.16.9 loads both at
    3 ranks and every master, moment, counter and client_state equals the truth, then trains a step.
    The output keeps the source's ds_version, key sets and zero_to_fp32.py."""
    venv, trained = older_deepspeed
    verdicts, args = {}, []
    for variant, (save_dir, truth) in trained.items():
        out = tmp_path / variant
        result = reshard_cli(save_dir, out, "--target-dp", "3")
        assert result.returncode == 0, result.stderr
        assert "io     : torch-free" in result.stdout and "torch  :" not in result.stdout, result.stdout
        assert (out / "zero_to_fp32.py").read_bytes() == (save_dir / "zero_to_fp32.py").read_bytes()
        assert not (out / "zero_to_torch.py").exists()  # 0.16.9 never wrote one
        # the pickled objects written back as 0.16.9 wrote them: the set, the loss scaler
        tag = (save_dir / "latest").read_text()
        model = "mp_rank_00_model_states.pt" if variant.startswith("z2") else None
        if model:
            assert _pickle_ops(out / tag / model, "'sparse_tensor_module_names'", 8) == \
                _pickle_ops(save_dir / tag / model, "'sparse_tensor_module_names'", 8)
            assert "GLOBAL     '__builtin__ set'" in " ".join(_pickle_ops(out / tag / model, "'sparse_tensor", 4))
        optim = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        assert _pickle_ops(out / tag / optim, "LossScaler", 16) == _pickle_ops(save_dir / tag / optim, "LossScaler", 16)
        source_files, target_files = _files(save_dir), _files(out)
        assert len(target_files) == (6 if variant.startswith("z3") else 4)
        for name, tree in target_files.items():
            meta = _metadata(tree)
            assert meta["ds_version"] and set(meta["ds_version"]) == {OLDER}, name
            # the source's file of the same rank, or its last rank's (rank 0 alone fills shared_params)
            twin = source_files.get(name) or source_files[re.sub(r"rank_\d+_mp", "rank_1_mp", name)]
            assert (meta["keys"], meta["nested"]) == (_metadata(twin)["keys"], _metadata(twin)["nested"]), name
        verdicts[variant] = tmp_path / f"{variant}.verdict.json"
        args.append([variant, out, truth, verdicts[variant]])
    first, *also = args
    launch = ["--variant", first[0], "--load-dir", first[1], "--truth", first[2], "--verdict", first[3]]
    for extra in also:
        launch += ["--also", *extra]
    run_torchrun("reshard_proof.check_load", 3, launch, python=venv.python, env=venv.env(),
                 expect_files=list(verdicts.values()))
    for variant, path in verdicts.items():
        verdict = json.loads(path.read_text())
        assert verdict["ok"], (variant, verdict)
        assert verdict["world_size"] == 3 and verdict["checked_elements"] > 0, verdict
