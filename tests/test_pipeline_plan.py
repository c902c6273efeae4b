"""Pure pipeline planning (reshard.layouts.pipeline): DeepSpeed's stage partition and each stage's names.

    python -m pytest -q tests/test_pipeline_plan.py

No process is started: DeepSpeed's own `partition_balanced` (runtime/utils.py) is imported and run
in this process as the oracle for the vectorised restatement.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.layouts.pipeline import (
    PipelineLayers,
    assign_stages,
    partition_balanced,
    stage_bounds,
    stage_names,
)

# few distinct weights, zeros among them, so that equal costs (where the tie rule decides) are common
WEIGHTS = st.lists(st.sampled_from([0, 0, 1, 3, 7, 24, 600, 888, 10**9]), max_size=40)


@settings(max_examples=300, deadline=None)
@given(WEIGHTS, st.integers(1, 12))
def test_partition_balanced_equals_deepspeeds_own(weights, parts):
    from deepspeed.runtime import utils as ds_utils
    assert partition_balanced(weights, parts) == [int(x) for x in ds_utils.partition_balanced(weights, parts)]


@st.composite
def pipeline_models(draw):
    """(PipelineLayers, numels by name in module order, stages): some layers without parameters, an
    optional tied module at two or three positions."""
    count = draw(st.integers(1, 16))
    tied_at = draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=3, unique=True)) \
        if count >= 2 and draw(st.booleans()) else []
    numels = {}
    for index in range(count):
        if index in tied_at:
            for param in ("weight", "bias"):
                numels.setdefault(f"tied_modules.embed.{param}", draw(st.integers(1, 500)))
            continue
        for param in range(draw(st.integers(0, 3))):
            numels[f"{index}.p{param}"] = draw(st.integers(1, 500))
    layers = PipelineLayers(count, {"embed": tuple(sorted(tied_at))} if tied_at else {})
    return layers, numels, draw(st.integers(1, 6))


@settings(max_examples=200, deadline=None)
@given(pipeline_models(), st.sampled_from(["parameters", "uniform"]))
def test_assignment_is_stage_bounds_and_stage_names_worked_out_once(model, method):
    layers, numels, stages = model
    assignment = assign_stages(method, layers, numels, stages)
    bounds = stage_bounds(method, layers, numels, stages)
    assert list(assignment.bounds) == bounds and assignment.method == method
    assert [list(names) for names in assignment.names] == \
        [stage_names(layers, bounds, stage, list(numels)) for stage in range(stages)]
    held = [name for names in assignment.names for name in names]
    untied = [name for name in numels if not name.startswith("tied_modules.")]
    assert sorted(name for name in held if not name.startswith("tied_modules.")) == sorted(untied)  # each once
    for stage, names in enumerate(assignment.names):  # a tied module sits, once, in every stage holding it
        holds_tied = any(bounds[stage] <= i < bounds[stage + 1] for i in layers.tied.get("embed", ()))
        tied = [name for name in names if name.startswith("tied_modules.")]
        assert tied == ([name for name in numels if name.startswith("tied_modules.")] if holds_tied else [])
