"""Invalid Distributed combinations fail before any process group exists, with one line that
names the key (CLI: exit 2); the rank layout and per-rank seeds follow the reference."""

from __future__ import annotations

import pytest

from gptforge.config import load_config
from gptforge.config.resolve import check_distributed
from gptforge.errors import ConfigError
from gptforge.train.dist_env import Topology, dropout_seed, topology

pytestmark = pytest.mark.distributed


def _cfg(world, *overrides):
    """The tiny config resolved as `world` processes would resolve it."""
    return load_config(overrides=["Model.preset=tiny", "Global.device=cpu", *overrides], world_size=world)


@pytest.mark.parametrize("world, overrides, key", [
    (2, ["Distributed.mp_degree=4"], "Distributed.mp_degree=4: needs a multiple of 4 processes"),
    (1, ["Distributed.sharding.sharding_degree=2"],
     "Distributed.sharding.sharding_degree=2: needs a multiple of 2 processes .* WORLD_SIZE is 1"),
    (4, ["Distributed.dp_degree=3"], "Distributed.dp_degree=3: needs 3 processes .* leave dp_degree blank"),
    (3, ["Distributed.mp_degree=2"], "Distributed.mp_degree=2: needs a multiple of 2 processes .* WORLD_SIZE is 3"),
    (4, ["Distributed.mp_degree=2", "Distributed.sharding.sharding_degree=4"],
     "Distributed.mp_degree=2 x Distributed.sharding.sharding_degree=4: needs a multiple of 8"),
    (4, ["Distributed.pp_degree=3"], "Distributed.pp_degree=3: needs a multiple of 3 processes"),
    (1, ["Model.sequence_parallel=True"], "Model.sequence_parallel: needs Distributed.mp_degree > 1"),
    (2, ["Distributed.mp_degree=2", "Model.layer_num_heads=[4,3]", "Model.head_dim=16"],
     "Distributed.mp_degree: 2 does not divide the attention head count 3"),
    (2, ["Distributed.mp_degree=2", "Model.ffn_hidden_size=255"], "Distributed.mp_degree: 2 does not divide the FFN"),
    (2, ["Distributed.mp_degree=2", "Model.sequence_parallel=True", "Data.Train.dataset.max_seq_len=33"],
     "Data.Train.dataset.max_seq_len: 33 is not divisible"),
    (2, ["Distributed.sharding.sharding_degree=2", "Engine.mix_precision.enable=True"],
     "Engine.mix_precision.dtype: float16 with tensor parallel or sharding"),
    (2, ["Distributed.backend=mpi"], "Distributed.backend: 'mpi' is not one of nccl, gloo"),
])
def test_invalid_combinations_name_the_key(world, overrides, key):
    cfg = _cfg(world, *overrides)
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(")", r"\)")) as e:
        check_distributed(cfg, world)
    assert "\n" not in str(e.value)


def test_heads_not_divisible_is_caught_when_the_config_resolves():
    with pytest.raises(ConfigError, match="Distributed.mp_degree: 3 does not divide Model.num_attention_heads 4"):
        _cfg(3, "Distributed.mp_degree=3")


@pytest.mark.parametrize("world, overrides", [
    (2, []), (2, ["Distributed.mp_degree=2", "Model.sequence_parallel=True"]),
    (4, ["Distributed.sharding.sharding_degree=2", "Distributed.mp_degree=2", "Engine.mix_precision.dtype=bfloat16",
         "Engine.mix_precision.enable=True"]),
    (8, ["Distributed.dp_degree=2", "Distributed.sharding.sharding_degree=2", "Distributed.mp_degree=2"]),
])
def test_valid_combinations_pass(world, overrides):
    cfg = _cfg(world, *overrides)
    check_distributed(cfg, world)
    assert (cfg.Distributed.dp_degree * cfg.Distributed.mp_degree * cfg.Distributed.sharding.sharding_degree) == world


def test_cli_reports_a_bad_launch_in_one_line_exit_2(tmp_path, run_cli, monkeypatch):
    from gptforge.config import save_config
    from test_train_support import train_config

    save_config(train_config(tmp_path), tmp_path / "run.yaml")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun would: fails before joining any group
    code, out, err = run_cli("pretrain", "-c", tmp_path / "run.yaml", "-o", "Distributed.mp_degree=4",
                             "--no-progress")
    assert code == 2
    assert err.count("\n") == 1 and "Distributed.mp_degree=4: needs a multiple of 4 processes" in err
    assert "torchrun --nproc_per_node=4" in err


def test_rank_layout_and_seeds_follow_the_reference():
    # mp innermost, then sharding, then dp (spec §2.5: data rank = dp_rank·sharding + sharding_rank)
    cfg = _cfg(8, "Distributed.dp_degree=2", "Distributed.sharding.sharding_degree=2", "Distributed.mp_degree=2")
    topos = [topology(cfg, 8, r) for r in range(8)]
    assert [t.mp_rank for t in topos] == [0, 1] * 4
    assert [t.sharding_rank for t in topos] == [0, 0, 1, 1] * 2
    assert [t.dp_rank for t in topos] == [0] * 4 + [1] * 4
    assert [t.data_rank for t in topos] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {t.data_world_size for t in topos} == {4}
    seeds = [dropout_seed(1024, t) for t in topos]
    assert all(seeds[r] == seeds[r ^ 1] for r in range(8))  # same across a tensor-parallel pair
    assert len(set(seeds)) == 4  # different for every data rank
    # global_seed = seed + 1024 + world + pp_rank·mp + dp_rank·mp·pp + sharding_rank·mp·pp·dp
    t = Topology(world_size=8, rank=7, dp=2, sharding=2, mp=2)
    assert dropout_seed(1024, t) == 1024 + 1024 + 8 + 1 * 2 + 1 * 2 * 2


@pytest.mark.parametrize("overrides, key", [
    (["Distributed.pp_degree=2", "Model.num_layers=1"], "Distributed.pp_degree: 2 pipeline stages"),
    (["Distributed.pp_degree=2", "Model.virtual_pp_degree=2"], "Distributed.pp_degree: 4 pipeline stages"),
    (["Distributed.pp_degree=2", "Distributed.pp_schedule=GPipe", "Model.virtual_pp_degree=2", "Model.num_layers=4"],
     "Model.virtual_pp_degree: 2 needs a multi-stage schedule"),
    (["Distributed.pp_degree=2", "Distributed.pp_schedule=LoopedBFS"], "Distributed.pp_schedule: LoopedBFS runs "
     "several stages per rank"),
    (["Distributed.pp_degree=2", "Distributed.pp_schedule=ZBVZeroBubble", "Model.virtual_pp_degree=3",
      "Model.num_layers=6"], "Model.virtual_pp_degree: ZBVZeroBubble runs exactly 2"),
    (["Distributed.pp_degree=2", "Distributed.pp_schedule=zigzag"], "Distributed.pp_schedule: 'zigzag' is not one"),
    (["Distributed.pp_degree=2", "Model.virtual_pp_degree=2", "Model.num_layers=4", "Global.global_batch_size=3",
      "Global.micro_batch_size=1"], "Global.micro_batch_size: Interleaved1F1B needs the accumulate steps \\(3\\)"),
    (["Distributed.pp_degree=2", "Global.global_batch_size=2", "Global.micro_batch_size=2"],
     "Global.micro_batch_size: 1F1B needs at least Distributed.pp_degree \\(2\\) micro-batches"),
    (["Distributed.pp_degree=2", "Global.global_batch_size=2", "Global.micro_batch_size=1",
      "Engine.mix_precision.enable=True"], "Engine.mix_precision.dtype: float16 with "
     "Distributed.pp_degree"),
    (["Distributed.pp_degree=2", "Distributed.sharding.sharding_degree=2", "Distributed.pp_schedule=ZBVZeroBubble",
      "Model.virtual_pp_degree=2", "Model.num_layers=4"], "Distributed.pp_schedule: ZBVZeroBubble puts"),
])
def test_invalid_pipeline_combinations_name_the_key(overrides, key):
    from gptforge.train.pipeline import check_pipeline_config

    world = 2 * (2 if any("mp_degree" in o or "sharding_degree" in o for o in overrides) else 1)
    cfg = _cfg(world, *overrides)
    check_distributed(cfg, world)
    with pytest.raises(ConfigError, match=key) as e:
        check_pipeline_config(cfg)
    assert "\n" not in str(e.value)


def test_pipeline_stages_split_by_layer_count():
    from gptforge.train.pipeline import rank_stages, stage_layers

    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert rank_stages(0, 2, 2, v_shape=False) == [0, 2] and rank_stages(1, 2, 2, v_shape=False) == [1, 3]
    assert rank_stages(0, 2, 2, v_shape=True) == [0, 3] and rank_stages(1, 2, 2, v_shape=True) == [1, 2]


def test_pipeline_topology_and_seeds():
    # dp 2 x pp 2 x mp 2: mp innermost, then pp; the stages of one pipeline read one data slice
    ts = [Topology(world_size=8, rank=r, dp=2, mp=2, pp=2) for r in range(8)]
    assert [(t.dp_rank, t.pp_rank, t.mp_rank) for t in ts[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert [t.data_rank for t in ts] == [0, 0, 0, 0, 1, 1, 1, 1]
    seeds = [dropout_seed(1, t) for t in ts]
    assert seeds[0] == seeds[1] and seeds[0] != seeds[2] and len(set(seeds)) == 4
