"""``MoEConfig``: validation, defaults, and one runtime whatever the front end.

Legend: R ranks, E experts, H hidden, F expert FFN size, K top-k, S tokens, E_r home experts.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest
import torch

from moonplan import MoonMoE, wrap_experts
from moonplan.adapters import MoonExperts
from moonplan.adapters.torchtitan import MoonGroupedExperts
from moonplan.runtime.config import MoEConfig
from moonplan.runtime.slot_budget import Bytes, default_slots
from moonplan.stepcost import StepCost

H, F, E, K = 8, 12, 6, 2

# The keyword defaults MoonMoE/MoonExperts/wrap had before the config existed.
OLD_DEFAULTS = {
    "slots": None,
    "align": 1,
    "max_tokens": 1024,
    "transport": "auto",
    "balance": "auto",
    "dtype": None,
    "overlap": True,
    "cost": None,
}


def _cost() -> StepCost:
    """Rows cost 1 us each, an expert copy 1 ms, traffic is free."""
    return StepCost(1e-6, 0.0, 0.0, 1e-3, 1e-3, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"hidden_size": 0}, "hidden_size must be an integer >= 1"),
        ({"ffn_size": 2.0}, "ffn_size must be an integer >= 1"),
        ({"num_experts": True}, "num_experts must be an integer >= 1"),
        ({"num_experts": 2, "top_k": 3}, r"top_k \(3\) cannot exceed num_experts \(2\)"),
        ({"slots": -1}, "slots must be >= 0"),
        ({"slots": "2 parsecs"}, "cannot read a byte size"),
        ({"slots": [2]}, "slots must be"),
        ({"align": 0}, "align must be an integer >= 1"),
        ({"max_tokens": -1}, "max_tokens must be an integer >= 0"),
        ({"transport": "nccl"}, r"transport.*'nccl'"),
        ({"balance": "balanced"}, "balance must be one of"),
        ({"dtype": torch.int32}, "dtype must be a floating torch.dtype"),
        ({"overlap": 1}, "overlap must be a bool"),
        ({"cost": 0.5}, "cost must be a moonplan.stepcost.StepCost"),
    ],
)
def test_bad_fields_raise_naming_the_field(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        MoEConfig(**fields)


def test_numpy_integer_sizes_are_kept_as_python_ints() -> None:
    import numpy as np

    cfg = MoEConfig(hidden_size=np.int64(H), top_k=np.int32(K), align=np.int64(4), max_tokens=0)
    assert (cfg.hidden_size, cfg.top_k, cfg.align, cfg.max_tokens) == (H, K, 4, 0)
    assert all(type(v) is int for v in (cfg.hidden_size, cfg.top_k, cfg.align, cfg.max_tokens))
    assert cfg.ffn_size is None  # unset sizes stay unset
    with pytest.raises(ValueError, match="top_k must be an integer >= 1, got "):
        MoEConfig(top_k=np.int64(0))


def test_defaults_equal_the_old_keyword_defaults() -> None:
    cfg = MoEConfig()
    assert {n: getattr(cfg, n) for n in OLD_DEFAULTS} == OLD_DEFAULTS
    layer = MoonMoE(H, F, E, K)  # no options: what the old keyword defaults built
    rt = layer.runtime
    assert rt.B == default_slots(E, 1) and rt.align == 1 and rt.kind == "auto"
    assert rt.balance == "auto" and rt.overlap and rt.balancer.cost is None
    assert rt.dtype == torch.get_default_dtype()
    assert rt.capacity == rt._capacity_for(1024 * K)


def test_bool_balance_is_a_deprecated_alias() -> None:
    with pytest.warns(DeprecationWarning, match="balance='exact'"):
        assert MoEConfig(balance=True).balance == "exact"
    with pytest.warns(DeprecationWarning, match="balance='off'"):
        assert MoEConfig().replace(balance=False).balance == "off"


def test_merged_replaces_fields_and_refuses_unknown_keywords() -> None:
    base = MoEConfig(slots=1, align=4)
    got = MoEConfig.merged(base, slots=3)
    assert (got.slots, got.align) == (3, 4) and base.slots == 1  # frozen: a new config
    assert MoEConfig.merged(None) == MoEConfig()
    with pytest.raises(TypeError, match="slot"):
        MoEConfig.merged(base, slot=3)
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        MoEConfig.merged({"slots": 3})  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.slots = 2  # type: ignore[misc]


def test_sizes_fill_in_and_must_agree() -> None:
    cfg = MoEConfig(top_k=K).sized(hidden_size=H, ffn_size=F, num_experts=E)
    assert cfg.require_sizes() == (H, F, E, K)
    assert cfg.slot_count(ranks=2) == default_slots(E, 2)
    assert MoEConfig(H, F, E, K, slots=0.5).slot_count(2) == 1  # M = 3
    with pytest.raises(
        ValueError, match=r"config\.hidden_size is 4, but this layer's weights give 8"
    ):
        MoEConfig(hidden_size=4).sized(hidden_size=8)
    with pytest.raises(ValueError, match="ffn_size is required"):
        MoEConfig(hidden_size=H).require_sizes()


def test_front_ends_refuse_bad_or_missing_options() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        MoonMoE(H, F, E, K, slot=2)
    with pytest.raises(ValueError, match="hidden_size is required"):
        MoonMoE(config=MoEConfig(ffn_size=F, num_experts=E, top_k=K))
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    with pytest.raises(ValueError, match=r"config\.num_experts is 5"):
        MoonExperts(gate_up, down, K, config=MoEConfig(num_experts=5))
    with pytest.raises(ValueError, match=r"config\.dtype"):
        MoonExperts(gate_up, down, K, config=MoEConfig(dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="top_k is required"):
        MoonExperts(gate_up, down)
    with pytest.raises(ValueError, match="neither"):
        MoonExperts(gate_up, None, K)


def _fingerprint(rt: Any) -> tuple:
    """What a runtime was built from, and what it built."""
    return (
        rt.config,
        (rt.E, rt.B, rt.H, rt.F, rt.K, rt.M, rt.align),
        (rt.dtype, rt.kind, rt.balance, rt.overlap, rt.capacity),
        rt.balancer.cost,
    )


def test_one_config_gives_one_runtime_through_every_front_end() -> None:
    cfg = MoEConfig(
        hidden_size=H,
        ffn_size=F,
        num_experts=E,
        top_k=K,
        slots=Bytes(3 * 3 * H * F * 4),  # three experts' fp32 bytes
        align=4,
        max_tokens=7,
        transport="a2a",
        balance="exact",
        dtype=torch.float32,
        overlap=False,
        cost=_cost(),
    )
    options = cfg.options()
    layer = MoonMoE(config=cfg)
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    w1, w3, w2 = gate_up[:, :F], gate_up[:, F:], down
    built = {
        "MoonMoE(config=)": layer,
        "MoonMoE(**keywords)": MoonMoE(**options),
        "MoonExperts": MoonExperts(gate_up, down, config=cfg),
        "MoonExperts(sizes from weights)": MoonExperts(
            gate_up, down, K, config=cfg.replace(hidden_size=None, ffn_size=None)
        ),
        "wrap_experts": wrap_experts(layer.route_fn, gate_up, down, config=cfg).experts,
        "MoonGroupedExperts": MoonGroupedExperts(w1, w2, w3, config=cfg),
    }
    want = _fingerprint(layer.runtime)
    assert want[1][1] == 3  # the byte budget became three slots; one staging row on top
    assert layer.runtime.S == 1
    for name, module in built.items():
        assert _fingerprint(module.runtime) == want, name
    assert layer.experts.runtime is layer.runtime  # the experts module owns it


def test_keywords_override_the_config() -> None:
    layer = MoonMoE(config=MoEConfig(H, F, E, K, slots=1, balance="off"), slots=3)
    assert (layer.slots, layer.runtime.balance) == (3, "off")
    assert layer.config.slots == 3


def test_moonmoe_is_a_router_in_front_of_moon_experts() -> None:
    """The layer and ``wrap_experts`` share one forward: the same weights give the same bits."""
    torch.manual_seed(0)
    layer = MoonMoE(H, F, E, K, balance="exact")
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    layer.load_dense(torch.randn(E, H), gate_up, down)
    routed = wrap_experts(layer.route_fn, gate_up, down, top_k=K, config=layer.config)
    x = torch.randn(2, 5, H)
    torch.testing.assert_close(layer(x), routed(x), rtol=0, atol=0)
    assert layer.gate_up is layer.experts.gate_up_proj and layer.down is layer.experts.down_proj
    assert sorted(n for n, _ in layer.named_parameters()) == [
        "experts.down_proj",
        "experts.gate_up_proj",
        "router.weight",
    ]


def test_wrap_and_wrap_model_take_the_config() -> None:
    pytest.importorskip("transformers")
    from moonplan import wrap, wrap_model
    from moonplan.adapters import moon_experts
    from tests.adapters.tiny import F as F_TINY
    from tests.adapters.tiny import H as H_TINY
    from tests.adapters.tiny import make_block, make_model

    opts: dict[str, Any] = {"slots": 1, "align": 4, "max_tokens": 7, "balance": "exact"}
    cfg = MoEConfig(**opts, overlap=False)
    by_config = wrap(make_block("mixtral"), config=cfg).experts
    by_keywords = wrap(make_block("mixtral"), **opts, overlap=False).experts
    assert _fingerprint(by_config.runtime) == _fingerprint(by_keywords.runtime)
    sizes = {"hidden_size": H_TINY, "ffn_size": F_TINY, "num_experts": 6, "top_k": 2}
    assert by_config.config == cfg.sized(**sizes, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"config\.num_experts is 5"):
        wrap(make_block("mixtral"), config=MoEConfig(num_experts=5))
    model = wrap_model(make_model("Mixtral"), config=cfg)  # sizes read per block
    layers = [ex for _, ex in moon_experts(model)]
    assert len(layers) == 2
    assert all(ex.config.align == 4 and ex.slots == 1 and not ex.runtime.overlap for ex in layers)


def test_resolve_lists_every_setting_that_shapes_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = MoEConfig(H, F, E, K, slots=10**6, cost=_cost(), transport="a2a-hosts")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    got = cfg.resolve(4)
    assert got.slots == E and got.transport_options == {"ranks_per_host": 2}
    agreed = got.agreed
    assert agreed["slots"] == E and agreed["dtype"] == torch.get_default_dtype()
    assert agreed["ranks_per_host (LOCAL_WORLD_SIZE)"] == 2
    assert agreed["cost"] == "StepCost" and agreed["cost.copy_s_intra"] == 1e-3
    assert {"balance", "max_tokens", "align", "overlap", "transport", "top_k"} <= set(agreed)
    assert not {"choose", "search_us"} & set(agreed)  # deprecated no-ops: not agreed
    assert MoEConfig(H, F, E, K).resolve(4).agreed["cost"] is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must divide the 4 ranks, got 3"):
        cfg.resolve(4)
    assert MoEConfig(H, F, E, K).resolve(4).transport_options == {}  # auto reads nothing


def test_the_config_is_a_tree_of_typed_sections() -> None:
    from moonplan.runtime.config import Balancing, Buffers, Sizes, Transfer

    cfg = MoEConfig(H, F, E, K, slots=2, transport="a2a", cost=_cost())
    assert cfg.sizes == Sizes(H, F, E, K) and cfg.buffers == Buffers(slots=2)
    assert cfg.transfer == Transfer("a2a") and cfg.balancing == Balancing(cost=_cost())
    names = [f.name for f in dataclasses.fields(cfg)]
    assert names == ["sizes", "buffers", "transfer", "balancing"]
    assert (cfg.slots, cfg.transport, cfg.top_k) == (2, "a2a", K)  # each option by its name
    assert MoEConfig(**cfg.options()) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
    with pytest.raises(AttributeError, match="no attribute 'slot'"):
        cfg.slot  # noqa: B018


def test_replace_takes_options_or_whole_sections() -> None:
    from moonplan.runtime.config import Buffers, Transfer

    cfg = MoEConfig(H, F, E, K, slots=1, align=4)
    got = cfg.replace(buffers=Buffers(slots=3), overlap=False)
    assert (got.slots, got.align, got.overlap, got.top_k) == (3, 1, False, K)
    assert cfg.replace(buffers=Buffers(slots=3), slots=5).slots == 5  # the option wins
    assert cfg.replace(transfer=Transfer("a2a")).transfer.transport == "a2a"
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        cfg.replace(slot=2)
    with pytest.raises(TypeError, match="buffers must be a Buffers, got Transfer"):
        cfg.replace(buffers=Transfer())
    with pytest.raises(ValueError, match="align must be an integer >= 1"):
        cfg.replace(align=0)
    with pytest.raises(TypeError, match="sized\\(\\) takes the sizes section's options"):
        cfg.sized(slots=2)
    with pytest.raises(TypeError):  # loud, not silent: the fields are the sections now
        dataclasses.replace(cfg, slots=2)


def test_the_keyword_signature_matches_the_sections() -> None:
    """``MoEConfig(...)``'s keywords are exactly the sections' options, with their defaults."""
    import inspect

    from moonplan.runtime.config import OPTIONS, SECTIONS

    params = inspect.signature(MoEConfig).parameters
    assert set(params) == set(OPTIONS)
    for cls in SECTIONS.values():
        assert set(cls.MEANING) == {f.name for f in dataclasses.fields(cls)}, cls.__name__
        for f in dataclasses.fields(cls):
            assert params[f.name].default == f.default, f.name


def test_the_api_page_shows_the_generated_option_table() -> None:
    from pathlib import Path

    from moonplan.runtime.config.table import option_table

    page = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    begin, end = "<!-- MoEConfig options: begin -->\n", "<!-- MoEConfig options: end -->"
    shown = page[page.index(begin) + len(begin) : page.index(end)]
    assert shown == option_table(), (
        "docs/api.md's option table is stale: put the output of "
        "`python -m moonplan.runtime.config.table` between its two markers"
    )
