"""Values DeepSpeed saves alike on every rank are checked equal across the source's files,
`param_shapes` against the weights, and loads leave torch's weights_only allowlist as they found it.

    python -m pytest -q tests/test_rank_values.py              # all
    python -m pytest -q tests/test_rank_values.py -m "not e2e"  # the allowlist under threads only

The e2e cases edit one value in a copy of a real trained checkpoint (torch.load, change, torch.save)
and expect exit status 2 with a message naming both files, the key and both values (reshard.cli.main
in this process: the message is the point, not the launcher; tests/test_bad_input.py runs the CLI).
"""
from __future__ import annotations

import io
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from reshard.formats.deepspeed_files import deepspeed_classes as classes
from reshard.formats.deepspeed_files import deepspeed_schema as schema
from reshard.formats.torch_bytes.torch_allowlist import allowed_globals

OPTIM1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
OPTIM0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL1_Z3 = "zero_pp_rank_1_mp_rank_00_model_states.pt"
MODEL0_Z3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"
MODEL_Z2 = "mp_rank_00_model_states.pt"


def _copy(trained, tmp_path: Path, variant: str) -> tuple[Path, Path]:
    original, _ = trained(variant, 2)
    copy = tmp_path / "src"
    shutil.copytree(original, copy)
    return copy, copy / (copy / "latest").read_text().strip()


def _edit(path: Path, change) -> None:
    state = torch.load(path, map_location="cpu", weights_only=False)
    change(state)
    torch.save(state, path)


def _set(*keys_and_value):
    *keys, last, value = keys_and_value

    def change(state):
        for key in keys:
            state = state[key]
        if isinstance(last, str) and not isinstance(state, (dict, list)):
            setattr(state, last, value)  # DeepSpeed's LossScaler
        else:
            state[last] = value
    return change


OSD = "optimizer_state_dict"
# (variant, file edited, edit, file it is compared with, key the message names, value here, rank 0's value)
CASES = {
    "lr": ("z2_fp32", OPTIM1, _set(OSD, "base_optimizer_state", "param_groups", 1, "lr", 0.5), OPTIM0,
           f"{OSD}.base_optimizer_state.param_groups[1].lr", "0.5", "0.000583"),
    "weight_decay": ("z2_fp32", OPTIM1, _set(OSD, "base_optimizer_state", "param_groups", 0, "weight_decay", 0.25),
                     OPTIM0, f"{OSD}.base_optimizer_state.param_groups[0].weight_decay", "0.25", "0.1"),
    "clip_grad": ("z2_fp32", OPTIM1, _set(OSD, "clip_grad", 2.0), OPTIM0, f"{OSD}.clip_grad", "2.0", "1.0"),
    "cur_scale": ("z2_fp32", OPTIM1, _set(OSD, "loss_scaler", "cur_scale", 4.0), OPTIM0,
                  f"{OSD}.loss_scaler.cur_scale", "4.0", "1.0"),
    "dynamic_loss_scale": ("z2_fp32", OPTIM1, _set(OSD, "dynamic_loss_scale", True), OPTIM0,
                           f"{OSD}.dynamic_loss_scale", "True", "False"),
    "overflow": ("z2_fp32", OPTIM1, _set(OSD, "overflow", True), OPTIM0, f"{OSD}.overflow", "True", "False"),
    "ds_config": ("z2_fp32", OPTIM1, _set("ds_config", "gradient_clipping", 3.0), OPTIM0,
                  "ds_config.gradient_clipping", "3.0", "1.0"),
    "z3_lr": ("z3_fp32", OPTIM1, _set(OSD, OSD, "param_groups", 0, "lr", 0.5), OPTIM0,
              f"{OSD}.{OSD}.param_groups[0].lr", "0.5", "0.000291"),
    "z3_global_steps": ("z3_fp32", MODEL1_Z3, _set("global_steps", 5), MODEL0_Z3, "global_steps", "5", "3"),
    "z3_lr_scheduler": ("z3_fp32", MODEL1_Z3, _set("lr_scheduler", "last_epoch", 9), MODEL0_Z3,
                        "lr_scheduler.last_epoch", "9", "3"),
    "z3_param_shapes": ("z3_fp32", MODEL1_Z3, _set("param_shapes", 0, "up.weight", torch.Size([13, 9])), MODEL0_Z3,
                        "param_shapes[0].up.weight", "[13, 9]", "[9, 13]"),
}
# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(*sorted({(case[0], 2) for case in CASES.values()}))


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_a_value_ranks_save_alike_that_differs_is_refused(trained, tmp_path, case):
    from trained import reshard_in_process
    variant, edited, change, rank0, key, here, there = CASES[case]
    save_dir, tag_dir = _copy(trained, tmp_path, variant)
    _edit(tag_dir / edited, change)
    result = reshard_in_process(save_dir, tmp_path / "dst", "--target-dp", "3")
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr
    assert message.startswith(f"reshard: error: {tag_dir / edited}: {key} is {here}"), message
    assert f"but {tag_dir / rank0} has {there}" in message, message
    assert "Traceback" not in message
    assert not (tmp_path / "dst" / "latest").exists()


@pytest.mark.e2e
def test_a_tensor_value_is_compared_by_its_bytes(trained, tmp_path):
    """torch optimizers take a tensor lr: both ranks' files get one, rank 1's of another value."""
    from trained import reshard_in_process
    save_dir, tag_dir = _copy(trained, tmp_path, "z2_fp32")
    for name, lr in ((OPTIM0, 0.25), (OPTIM1, 0.5)):
        _edit(tag_dir / name, _set(OSD, "base_optimizer_state", "param_groups", 0, "lr", torch.tensor(lr)))
    result = reshard_in_process(save_dir, tmp_path / "dst", "--target-dp", "3")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"reshard: error: {tag_dir / OPTIM1}: {OSD}.base_optimizer_state.param_groups[0]"
                                    f".lr is tensor float32 [] [0.5], but {tag_dir / OPTIM0} has tensor float32 [] "
                                    "[0.25]"), result.stderr


@pytest.mark.e2e
def test_transposed_param_shapes_are_refused(trained, tmp_path):
    """The ZeRO-2 model file's param_shapes say [13, 9] for a [9, 13] weight: the same element count,
    so the partitions agree, but zero_to_fp32.py would reshape the parameter wrongly."""
    from trained import reshard_in_process
    save_dir, tag_dir = _copy(trained, tmp_path, "z2_fp32")
    _edit(tag_dir / MODEL_Z2, _set("param_shapes", 0, "up.weight", torch.Size([13, 9])))
    result = reshard_in_process(save_dir, tmp_path / "dst", "--target-dp", "3")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"reshard: error: {tag_dir / MODEL_Z2}: param_shapes says up.weight has shape "
                                    "[13, 9], but its tensor in module has shape [9, 13]"), result.stderr


@pytest.mark.e2e
def test_a_resaved_rank_file_with_the_same_values_passes(trained, tmp_path):
    """torch.load + torch.save of rank 1's files with a value set back to what it was changes no
    value, so the checks above pass it: they compare values, not bytes."""
    from trained import reshard_in_process
    save_dir, tag_dir = _copy(trained, tmp_path, "z2_fp32")
    _edit(tag_dir / OPTIM1, _set(OSD, "clip_grad", 1.0))
    _edit(tag_dir / MODEL_Z2, lambda state: None)
    result = reshard_in_process(save_dir, tmp_path / "dst", "--target-dp", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "dst" / "latest").exists()


# The in-job load at 3 ranks leaving torch's allowlist as it found it is checked with the other
# in-job loads, in one launch: tests/test_e2e_reshard.py::test_in_job_resharding_loads_bit_exactly[z2_fp32-2to3].


def _file_with_deepspeed_classes() -> bytes:
    """An optim-states-like file whose pickle names DeepSpeed's LossScaler and fragment_address,
    written as reshard writes them (the stand-ins under DeepSpeed's names)."""
    scaler = classes.LossScaler()
    scaler.__dict__.update(cur_scale=1.0, dynamic=False)
    out = io.BytesIO()
    torch.save({OSD: {"loss_scaler": scaler, "param_slice_mappings": [{"w": classes.fragment_address(3, 0)}],
                      "partition": torch.arange(4.0)}}, out, pickle_module=classes)
    return out.getvalue()


def test_allowlist_scopes_in_threads_keep_it_while_loading_and_restore_it(tmp_path):
    """Eight threads hold the stand-ins at once and leave one by one: each one's weights_only load
    still succeeds after the others have left (torch's bare `safe_globals` context manager removes
    them at the first exit), an entry the process had allowed before is kept, and afterwards the
    allowlist is what it was."""
    data = _file_with_deepspeed_classes()
    entries = schema.safe_globals()
    kept = entries[0]
    with torch.serialization.safe_globals([kept]):  # allowed by "the process" before reshard runs
        before = set(torch.serialization.get_safe_globals())
        inside, errors = threading.Barrier(8), []

        def load(index: int) -> None:
            try:
                with allowed_globals(entries):
                    inside.wait(timeout=30)
                    time.sleep(0.01 * index)  # leave one after the other
                    tree = torch.load(io.BytesIO(data), weights_only=True)
                    assert tree[OSD]["loss_scaler"].cur_scale == 1.0
            except Exception as error:  # noqa: BLE001 (reported below)
                errors.append(f"thread {index}: {type(error).__name__}: {error}"[:300])

        threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert set(torch.serialization.get_safe_globals()) == before
        assert kept in before
    assert kept not in set(torch.serialization.get_safe_globals())


def test_torch_fallback_reader_leaves_the_allowlist_as_it_found_it(tmp_path):
    """torch_archive.load_structure (the reader's torch path) from four threads at once: every load
    reads the DeepSpeed classes, and no stand-in stays registered afterwards."""
    from reshard.formats.torch_bytes.torch_archive import load_structure
    path = tmp_path / "optim.pt"
    path.write_bytes(_file_with_deepspeed_classes())
    before = set(torch.serialization.get_safe_globals())
    results, errors = [], []

    def load() -> None:
        try:
            for _ in range(5):
                results.append(load_structure(path, schema.safe_globals())[OSD]["param_slice_mappings"][0]["w"])
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(f"{type(error).__name__}: {error}"[:300])

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [(r.numel, r.start) for r in results] == [(3, 0)] * 20
    assert set(torch.serialization.get_safe_globals()) == before


def test_compare_finds_the_first_difference_by_key_path():
    from reshard.formats.deepspeed_files.deepspeed_rank_values import compare
    scaler0, scaler1 = classes.LossScaler(), classes.LossScaler()
    scaler0.__dict__.update(cur_scale=1.0, dynamic=False)
    scaler1.__dict__.update(cur_scale=1.0, dynamic=False)
    rank0 = {"loss_scaler": scaler0, "groups": [{"lr": float("nan"), "betas": (0.9, 0.95)}], "shape": (9, 13)}
    same = {"loss_scaler": scaler1, "groups": [{"lr": float("nan"), "betas": (0.9, 0.95)}], "shape": (9, 13)}
    assert compare(same, rank0) == (None, [])  # NaN equals NaN; stand-ins by their attributes
    scaler1.cur_scale = 2.0
    assert compare(same, rank0)[0] == ("loss_scaler.cur_scale", 2.0, 1.0)
    scaler1.cur_scale = 1.0
    same["groups"][0]["betas"] = (0.9, 1)
    assert compare(same, rank0)[0] == ("groups[0].betas[1]", 1, 0.95)  # types must agree
    same["groups"][0]["betas"] = (0.9, 0.95)
    same["shape"] = (13, 9)
    assert compare(same, rank0)[0] == ("shape", (13, 9), (9, 13))  # shapes compare whole
    assert compare({"overflow": True}, {"overflow": 1})[0] == ("overflow", True, 1)


def test_compare_walks_shared_subtrees_once():
    """A crafted pickle's nested shared tuples (2**200 leaves when expanded) compare at once."""
    from reshard.formats.deepspeed_files.deepspeed_rank_values import compare
    a, b = (1.0,), (1.0,)
    for _ in range(200):
        a, b = (a, a), (b, b)
    started = time.perf_counter()
    assert compare({"ds_config": a}, {"ds_config": b}) == (None, [])
    assert time.perf_counter() - started < 1.0
