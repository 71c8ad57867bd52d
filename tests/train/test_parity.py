"""Data parallelism: two ranks under the `deepspeed` launcher with ZeRO-1, -2 and -3 give the
losses of one process (relative difference <= 1e-4 over 5 steps). The first DeepSpeed CPU run
on a machine compiles `deepspeed_shm_comm_op` (~2.5 min, cached in ~/.cache/torch_extensions)."""

from __future__ import annotations

import pytest

from .conftest import losses, ncpctl, result

# micro batch 2, global 8: one process accumulates 4 micro-batches, two ranks 2 each
SETS = ["--set", "train.max_steps=5", "--set", "train.micro_batch_size=2", "--set", "train.eval_every=0",
        "--set", "train.save_every=0"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_data):
    from .conftest import RECIPE

    root = tmp_path_factory.mktemp("single")
    recipe = root / "one.yaml"
    recipe.write_text(RECIPE.format(data=tiny_data, run=root / "one"))
    r = result(ncpctl("pretrain", str(recipe), "--json", *SETS))
    assert r["world_size"] == 1 and r["zero_stage"] == 0
    return losses(root / "one")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ranks_match_one_process(stage: int, single, make_recipe, tmp_path) -> None:
    recipe = make_recipe(f"z{stage}")
    proc = ncpctl("pretrain", str(recipe), "--json", *SETS, "--set", f"deepspeed.zero_stage={stage}",
                  launcher_ranks=2, timeout=600)
    r = result(proc)
    assert r["world_size"] == 2 and r["zero_stage"] == stage
    got = losses(tmp_path / f"z{stage}")
    assert [s for s, _ in got] == [s for s, _ in single] == [1, 2, 3, 4, 5]
    for (_, a), (_, b) in zip(single, got):
        assert abs(a - b) / abs(a) <= 1e-4, (single, got)
