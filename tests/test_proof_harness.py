"""The proof harness judges checkpoints correctly: native loads pass, tampered ones fail.

    python -m pytest tests/test_proof_harness.py            # everything (~1-2 min on 2 cores)
    python -m pytest tests/test_proof_harness.py -m "not e2e"   # single-process parts only

Multi-rank tests use the session's trained checkpoints (tests/conftest.py `trained`); the three
loads at 2 ranks share one launch.
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed in this process

from reshard_proof.bitwise import compare_trees  # noqa: E402
from reshard_proof.launch import (  # noqa: E402
    TorchrunError,
    check_checkpoint,
    child_env,
    run_torchrun,
)
from reshard_proof.model import ProofModel, build_param_groups  # noqa: E402
from reshard_proof.negative_controls import copy_checkpoint, flip_fp32_partition_bit  # noqa: E402
from reshard_proof.variants import VARIANTS, get_variant  # noqa: E402
from reshard_proof.zero_to_fp32_check import UNSUPPORTED, check_zero_to_fp32  # noqa: E402

SOURCE_RANKS = 2
# the checkpoints its tests ask `trained` for, trained with the session's others (conftest.py)
pytestmark = pytest.mark.trains(*[(variant, SOURCE_RANKS) for variant in ("z2_fp32", "z3_bf16", "bf16_optimizer")])


# --- single process ---------------------------------------------------------------------------

@pytest.mark.e2e  # a fresh interpreter: this one has imported deepspeed already
def test_importing_the_package_does_not_import_deepspeed():
    code = "import sys, reshard_proof; assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                   env=child_env())  # reshard_proof lives in tests/, found through PYTHONPATH


def test_bitwise_comparison_sees_signed_zero_nan_payload_dtype_and_float_bits():
    assert compare_trees(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0])).ok
    assert not compare_trees(torch.tensor([0.0]), torch.tensor([-0.0])).ok
    assert not compare_trees(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64)).ok
    assert not compare_trees({"lr": 0.1}, {"lr": math.nextafter(0.1, 1.0)}).ok
    mismatch = compare_trees({"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 3).index_fill_(1, torch.tensor([2]), 1)})
    assert mismatch.mismatches == ["<root>['w']: first difference at index [0, 2] (flat 2): expected 0.0, got 1.0; "
                                   "2 of 6 elements differ"]


def test_every_required_variant_is_registered():
    required = {f"z{stage}_{precision}" for stage in (1, 2, 3) for precision in ("fp32", "fp16", "bf16")}
    required |= {"bf16_optimizer", "z3_subgroups", "z2_round_robin", "z2_param_alignment", "z1_bf16_param_alignment",
                 "z2_exclude_frozen", "z3_exclude_frozen", "z2_sgd_momentum", "z3_sgd_momentum"}
    assert required <= set(VARIANTS)
    assert get_variant("bf16_optimizer").ds_config()["data_types"] == {"grad_accum_dtype": "fp32"}
    assert get_variant("z2_round_robin").ds_config()["zero_optimization"]["round_robin_gradients"] is True
    assert get_variant("z2_param_alignment").ds_config()["zero_optimization"]["parameter_alignment"] is True


def test_model_groups_need_padding_at_every_world_size():
    model = ProofModel()
    groups = build_param_groups(model)
    assert [group["name"] for group in groups] == ["decay", "no_decay"]
    assert groups[0]["lr"] != groups[1]["lr"] and groups[0]["weight_decay"] != groups[1]["weight_decay"]
    for group in groups:
        numel = sum(param.numel() for param in group["params"])
        for world_size in range(1, 9):  # ZeRO-1/2 pad each group to a multiple of 2 * W
            assert numel % (2 * world_size) != 0
    trainable = {id(param) for group in groups for param in group["params"]}
    assert not any(id(param) in trainable for param in model.frozen_proj.parameters())
    assert model.head.weight is model.embed.weight


def test_frozen_layer_ignores_the_model_seed():
    torch.manual_seed(0)
    first = ProofModel()
    torch.manual_seed(1)
    second = ProofModel()
    assert torch.equal(first.frozen_proj.weight, second.frozen_proj.weight)
    assert not torch.equal(first.up.weight, second.up.weight)


# --- launcher ---------------------------------------------------------------------------------

@pytest.fixture
def fake_entry_point(tmp_path):
    """A torchrun module that writes its file, then aborts at exit the first time only."""
    (tmp_path / "fake_proof_entry.py").write_text(textwrap.dedent("""
        import os, sys
        out, marker = sys.argv[1], sys.argv[2]
        with open(out, "w") as f:
            f.write('{"ok": true}')
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.abort()
    """))
    return tmp_path


@pytest.mark.e2e
def test_launcher_retries_once_when_a_run_dies_after_writing_its_files(fake_entry_point):
    out, marker = fake_entry_point / "out.json", fake_entry_point / "aborted_once"
    env = {"PYTHONPATH": f"{fake_entry_point}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = run_torchrun("fake_proof_entry", 1, [out, marker], env=env, timeout=120, expect_files=[out])
    assert result.returncode == 0 and marker.exists() and out.exists()


@pytest.mark.e2e
def test_launcher_raises_with_output_when_files_are_missing(fake_entry_point):
    env = {"PYTHONPATH": f"{fake_entry_point}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with pytest.raises(TorchrunError, match="missing or incomplete"):
        run_torchrun("fake_proof_entry", 1, [fake_entry_point / "out.json", fake_entry_point / "m"], env=env,
                     timeout=120, expect_files=[fake_entry_point / "never_written.json"])


# --- multi-rank, real DeepSpeed ---------------------------------------------------------------

def _trained(trained, variant: str) -> dict:
    """The session's checkpoint of `variant` at SOURCE_RANKS (tests/conftest.py `trained`, the same
    train_checkpoint call this file made for itself before)."""
    ckpt, truth = trained(variant, SOURCE_RANKS)
    return {"variant": variant, "ckpt": ckpt, "truth": truth}


@pytest.fixture(scope="session")
def z2_fp32_checkpoint(trained):
    return _trained(trained, "z2_fp32")


@pytest.fixture(scope="session")
def z3_bf16_checkpoint(trained):
    return _trained(trained, "z3_bf16")


@pytest.fixture(scope="module")
def judged_at_source_ranks(z2_fp32_checkpoint, z3_bf16_checkpoint, tmp_path_factory):
    """({name: verdict or its error}, parameter touched) of the two native loads and of a z2_fp32 copy with one fp32
    partition bit flipped on rank 1 (name "tampered"), all three in
    one launch at SOURCE_RANKS (tests/trained.py judge_together)."""
    from trained import judge_together
    root = tmp_path_factory.mktemp("proof-harness")
    tampered = copy_checkpoint(z2_fp32_checkpoint["ckpt"], root / "tampered")
    touched = flip_fp32_partition_bit(tampered, rank=1)
    jobs = {"z2_fp32_checkpoint": (SOURCE_RANKS, "z2_fp32", z2_fp32_checkpoint["ckpt"], z2_fp32_checkpoint["truth"]),
            "z3_bf16_checkpoint": (SOURCE_RANKS, "z3_bf16", z3_bf16_checkpoint["ckpt"], z3_bf16_checkpoint["truth"]),
            "tampered": (SOURCE_RANKS, "z2_fp32", tampered, z2_fp32_checkpoint["truth"])}
    verdicts = judge_together([(*job, root / f"verdict_{name}.json") for name, job in jobs.items()])
    return {name: verdicts[str(root / f"verdict_{name}.json")] for name in jobs}, touched


@pytest.mark.e2e
@pytest.mark.parametrize("checkpoint", ["z2_fp32_checkpoint", "z3_bf16_checkpoint"])
def test_native_load_matches_the_truth(checkpoint, judged_at_source_ranks):
    from trained import verdict_of
    verdict = verdict_of(judged_at_source_ranks[0], checkpoint)
    assert verdict["ok"], verdict["mismatches"] or verdict["load_error"]
    assert verdict["checked_tensors"] > 0 and verdict["checked_elements"] > 0
    assert verdict["eval_loss"] == verdict["truth_eval_loss"]
    assert len(verdict["extra_step_losses"]) == SOURCE_RANKS


@pytest.mark.e2e
def test_one_flipped_bit_in_one_rank_fp32_partition_is_caught_and_named(judged_at_source_ranks):
    from trained import verdict_of
    verdicts, touched = judged_at_source_ranks
    verdict = verdict_of(verdicts, "tampered")
    assert not verdict["ok"]
    assert any(f"['{touched}']['fp32']" in mismatch for mismatch in verdict["mismatches"]), verdict["mismatches"]


@pytest.mark.e2e
def test_zero_to_fp32_agrees_with_the_truth(z2_fp32_checkpoint):
    assert check_zero_to_fp32(z2_fp32_checkpoint["ckpt"], z2_fp32_checkpoint["truth"]) == []


@pytest.mark.e2e
def test_zero_to_fp32_reports_bf16_optimizer_checkpoints_as_unsupported(trained):
    paths = _trained(trained, "bf16_optimizer")
    mismatches = check_zero_to_fp32(paths["ckpt"], paths["truth"])
    assert len(mismatches) == 1 and mismatches[0].startswith(UNSUPPORTED)


@pytest.mark.e2e
def test_plain_deepspeed_refuses_another_world_size_and_the_verdict_says_so(z2_fp32_checkpoint, tmp_path):
    """The baseline the resharder exists for: N=2 files loaded at M=1 without resharding."""
    verdict = check_checkpoint("z2_fp32", 1, z2_fp32_checkpoint["ckpt"], z2_fp32_checkpoint["truth"],
                               tmp_path / "verdict_m1.json")
    assert not verdict["ok"] and "world size" in verdict["load_error"]
