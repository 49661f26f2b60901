"""Tests of moonplan.cost and the ``moonplan cost`` subcommand.

The Mixtral 8x7B figures are the worked examples of docs/cost.md and must match exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from moonplan import cost
from moonplan.cli.cost import register
from moonplan.cost import (
    ALL_TO_ALL,
    ALLGATHER_REDUCESCATTER,
    BACKENDS,
    PRESETS,
    comm_per_rank,
    count_params,
    get_preset,
    memory_per_rank,
)

MIXTRAL = get_preset("mixtral-8x7b")


# --------------------------------------------------------------------------- seed figures


def test_mixtral_param_split_matches_seed():
    p = count_params(MIXTRAL)
    assert p.expert == 45_097_156_608
    assert p.replicated == 1_474_297_856
    assert p.attention == 1_342_177_280
    assert p.router == 1_048_576
    assert p.embedding == 131_072_000
    assert p.lm_head == 0
    assert p.total == 46_571_454_464  # 45.10B + 1.474B = 46.57B (seed)
    assert p.active == 2 * 4096 * 14336 * 3 * 32 + 1_474_297_856
    assert f"{p.active / 1e9:.2f}" == "12.75"


@pytest.mark.parametrize(
    ("ep", "expert", "replicated", "total"),
    [(8, "10.50", "2.75", "13.25"), (16, "5.25", "2.75", "8.00")],
)
def test_mixtral_memory_per_rank_matches_seed(ep, expert, replicated, total):
    m = memory_per_rank(MIXTRAL, ep=ep)
    assert (f"{m.expert_gib:.2f}", f"{m.replicated_gib:.2f}") == (expert, replicated)
    assert f"{m.total_gib:.2f}" == total
    assert m.expert_bytes == 45_097_156_608 * 2 / ep
    assert m.replicated_bytes == 1_474_297_856 * 2


@pytest.mark.parametrize(
    ("backend", "tokens", "figures"),
    [
        (ALL_TO_ALL, 512, (7.0, 14.0, 448.0)),
        (ALL_TO_ALL, 2048, (28.0, 56.0, 1792.0)),
        (ALLGATHER_REDUCESCATTER, 512, (28.0, 56.0, 1792.0)),
        (ALLGATHER_REDUCESCATTER, 2048, (112.0, 224.0, 7168.0)),
    ],
)
def test_mixtral_dispatch_matches_seed(backend, tokens, figures):
    c = comm_per_rank(MIXTRAL, ep=8, tokens=tokens, backend=backend)
    assert (c.dispatch_mib, c.layer_mib, c.forward_mib) == figures
    assert c.combine_bytes == c.dispatch_bytes
    assert c.num_layers == 32


def test_direct_dispatch_bytes_exact():
    # 512 x 2 x 4096 x 2 x (7/8) = 7,340,032 B; 2048 tokens: 29,360,128 B (seed)
    assert cost.all_to_all_dispatch_bytes(512, 2, 4096, 8) == 7_340_032
    assert cost.all_to_all_dispatch_bytes(2048, 2, 4096, 8) == 29_360_128
    assert cost.allgather_dispatch_bytes(512, 4096, 8) == 7 * 512 * 4096 * 2


def test_allgather_is_ep_over_k_times_direct():
    for ep in (2, 4, 8, 16):
        direct = cost.all_to_all_dispatch_bytes(1024, 2, 4096, ep)
        gathered = cost.allgather_dispatch_bytes(1024, 4096, ep)
        assert gathered == pytest.approx(direct * ep / 2)


# --------------------------------------------------------------------------- scaling


def test_tp_divides_replicated_only():
    one = memory_per_rank(MIXTRAL, ep=8, tp=1)
    four = memory_per_rank(MIXTRAL, ep=8, tp=4)
    assert four.expert_bytes == one.expert_bytes
    assert four.replicated_bytes == one.replicated_bytes / 4


def test_bytes_per_param_scales_linearly():
    bf16 = memory_per_rank(MIXTRAL, ep=8)
    fp8 = memory_per_rank(MIXTRAL, ep=8, bytes_per_param=1)
    fp4 = memory_per_rank(MIXTRAL, ep=8, bytes_per_param=0.5)
    assert fp8.total_bytes == bf16.total_bytes / 2
    assert fp4.total_bytes == bf16.total_bytes / 4


def test_ep_one_and_zero_tokens_move_nothing():
    for backend in BACKENDS:
        assert comm_per_rank(MIXTRAL, ep=1, tokens=512, backend=backend).forward_bytes == 0
        assert comm_per_rank(MIXTRAL, ep=8, tokens=0, backend=backend).forward_bytes == 0


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("ep", [0, -1, 2.0, True, "8"])
def test_bad_ep_raises(ep):
    with pytest.raises(ValueError, match="ep must be an integer >= 1"):
        memory_per_rank(MIXTRAL, ep=ep)
    with pytest.raises(ValueError, match="ep must be an integer >= 1"):
        comm_per_rank(MIXTRAL, ep=ep, tokens=512)


def test_bad_tp_tokens_bytes_raise():
    with pytest.raises(ValueError, match="tp must be"):
        memory_per_rank(MIXTRAL, ep=8, tp=0)
    with pytest.raises(ValueError, match="tokens must be an integer >= 0"):
        comm_per_rank(MIXTRAL, ep=8, tokens=-1)
    for bad in (0, -2, float("nan"), float("inf"), "2"):
        with pytest.raises(ValueError, match="bytes"):
            memory_per_rank(MIXTRAL, ep=8, bytes_per_param=bad)
        with pytest.raises(ValueError, match="bytes"):
            comm_per_rank(MIXTRAL, ep=8, tokens=1, bytes_per_elem=bad)


def test_unknown_backend_names_choices():
    with pytest.raises(ValueError, match="all_to_all, allgather_reducescatter"):
        comm_per_rank(MIXTRAL, ep=8, tokens=512, backend="deepep")


def test_unknown_preset_names_choices():
    with pytest.raises(ValueError) as info:
        get_preset("gpt-5")
    message = str(info.value)
    assert "'gpt-5'" in message
    for name in PRESETS:
        assert name in message


# --------------------------------------------------------------------------- presets


def test_registry_is_read_only_and_case_insensitive():
    assert set(PRESETS) == {"mixtral-8x7b", "deepseek-v3", "kimi-k3-like"}
    with pytest.raises(TypeError):
        PRESETS["x"] = MIXTRAL  # type: ignore[index]
    assert get_preset("Mixtral-8x7B") is MIXTRAL
    for name, preset in PRESETS.items():
        assert preset.name == name
        assert preset.source
        with pytest.raises(dataclasses.FrozenInstanceError):
            preset.top_k = 1  # type: ignore[misc]


def test_deepseek_v3_total_and_active():
    model = get_preset("deepseek-v3")
    p = count_params(model)
    assert p.total == pytest.approx(671e9, rel=0.01)  # report: 671B total (no MTP module)
    assert p.active == pytest.approx(37e9, rel=0.03)  # report: 37B activated
    assert p.attention == 187_105_280 * 61
    assert p.lm_head == p.embedding == 129280 * 7168
    assert model.num_moe_layers == 58


def test_kimi_k3_like_uses_seed_e_and_k():
    model = get_preset("kimi-k3-like")
    assert (model.num_experts, model.top_k) == (896, 16)
    assert model.assumptions
    p = count_params(model)
    assert p.expert == 3 * 7168 * 2048 * 896 * 60


def test_kimi_k2_dims_reproduce_published_k2_size():
    # The assumed dimensions with K2's own E=384, K=8 give K2's published ~1T total, 32B active.
    k2 = dataclasses.replace(get_preset("kimi-k3-like"), num_experts=384, top_k=8)
    p = count_params(k2)
    assert p.total == pytest.approx(1.04e12, rel=0.02)
    assert p.active == pytest.approx(32e9, rel=0.03)


def test_gqa_attention_matches_seed_convention():
    attn = cost.GQAAttention(num_heads=32, num_kv_heads=8, head_dim=128)
    assert attn.params(4096) == 2 * 4096 * 4096 + 2 * 4096 * 1024


# --------------------------------------------------------------------------- CLI


def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="moonplan")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


def test_cli_mixtral_table(capsys):
    code, out = _run(["cost", "--model", "mixtral-8x7b", "--ep", "8", "--tokens", "512"], capsys)
    assert code == 0
    for figure in ("7.0 MiB", "14.0 MiB", "448.0 MiB", "28.0 MiB", "56.0 MiB", "1792.0 MiB"):
        assert figure in out
    for figure in ("10.50 GiB", "2.75 GiB", "13.25 GiB", "45,097,156,608", "1,474,297,856"):
        assert figure in out


def test_cli_defaults_and_ep16(capsys):
    code, out = _run(["cost", "--ep", "16"], capsys)
    assert code == 0
    assert "5.25 GiB" in out and "8.00 GiB" in out
    assert "EP=16 > E=8" in out


def test_cli_json(capsys):
    argv = ["cost", "--model", "mixtral-8x7b", "--tokens", "2048", "--json"]
    code, out = _run(argv, capsys)
    assert code == 0
    report = json.loads(out)
    assert report["params"]["expert"] == 45_097_156_608
    a2a = report["comm_per_rank"]["all_to_all"]
    assert a2a["forward_mib"] == 1792.0
    assert report["comm_per_rank"]["allgather_reducescatter"]["forward_mib"] == 7168.0


@pytest.mark.parametrize(
    "argv",
    [["cost", "--ep", "0"], ["cost", "--tokens", "-1"], ["cost", "--model", "nope"]],
)
def test_cli_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _run(argv, capsys)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err
