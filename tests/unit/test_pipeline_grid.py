"""The pipeline axis of ProcessGrid, on thread ranks (mpidl.testing.run_ranks)."""
from __future__ import annotations

import pytest

from mpidl.parallel import ProcessGrid
from mpidl.testing import run_ranks


def _members(comm, **sizes):
    grid = ProcessGrid(comm, **sizes)
    out = {name: getattr(grid, name).allgather_obj(comm.rank)
           for name in ("tensor", "sequence", "data", "pipeline", "replicas")}
    out["at"] = (grid.pipeline_rank, *grid.coordinates)
    out["back"] = grid.world_rank(*grid.coordinates, pipeline=grid.pipeline_rank)
    out["repr"] = repr(grid)
    grid.free()
    return out


@pytest.mark.parametrize("sizes", [dict(pipeline=2, tensor=2), dict(pipeline=2, sequence=2),
                                   dict(pipeline=4), dict(pipeline=2, tensor=2, sequence=2)])
def test_the_pipeline_axis_is_outermost_and_each_group_holds_its_coordinates(sizes):
    world = run_ranks(8, _members, **sizes)
    t, s, p = (sizes.get(k, 1) for k in ("tensor", "sequence", "pipeline"))
    d = 8 // (t * s * p)
    for w, got in enumerate(world):
        # w = ((pipe * d + data) * s + seq) * t + ten: a stage is a block of 8/p ranks
        pipe, data, seq, ten = got["at"]
        assert w == ((pipe * d + data) * s + seq) * t + ten == got["back"]
        assert pipe == w // (8 // p)
        same = {name: [v for v in range(8) if all(
            world[v]["at"][i] == got["at"][i] for i in keep)]
            for name, keep in (("tensor", (0, 1, 2)), ("sequence", (0, 1, 3)),
                               ("data", (0, 2, 3)), ("pipeline", (1, 2, 3)),
                               ("replicas", (0, 3)))}
        for name, ranks in same.items():
            assert got[name] == ranks, (name, w, got)
    assert "pipeline=" in world[0]["repr"] and "stage 0" in world[0]["repr"]


def test_without_a_pipeline_the_grid_is_the_one_every_caller_knew():
    world = run_ranks(4, _members, tensor=2)
    assert [g["at"] for g in world] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1)]
    assert all(g["pipeline"] == [w] for w, g in enumerate(world))
    assert world[3]["replicas"] == [1, 3]
    assert "pipeline" not in world[0]["repr"]


def test_a_pipeline_that_does_not_divide_the_world_is_refused_on_every_rank():
    errors = run_ranks(4, lambda c: ProcessGrid(c, pipeline=3, tensor=1),
                       return_exceptions=True)
    assert all(isinstance(e, ValueError) and "pipeline=3" in str(e) for e in errors)
    errors = run_ranks(2, lambda c: ProcessGrid(c, pipeline=0), return_exceptions=True)
    assert all(isinstance(e, ValueError) and "positive" in str(e) for e in errors)
