"""The model registry and the shared weight-loading helpers (tandem/models/registry.py,
tandem/models/base.py): one family module per architecture, imported only when asked
for; the stacked-parameter mapping matches whole name components."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tandem.models.base import DENSE_STACKED_PARAMS, CausalLM, LayerOptions, StackedParam, stacked_param_target
from tandem.models.registry import ARCHITECTURES, resolve_model_class


def test_every_architecture_resolves_to_its_family_class():
    for arch, module in ARCHITECTURES.items():
        cls = resolve_model_class(SimpleNamespace(architectures=[arch]))
        assert cls.__name__ == arch and cls.__module__ == f"tandem.models.{module}"
        assert issubclass(cls, CausalLM)


def test_every_family_module_registers_its_entry_classes():
    for module in set(ARCHITECTURES.values()):
        for cls in importlib.import_module(f"tandem.models.{module}").EntryClass:
            assert ARCHITECTURES[cls.__name__] == module


def test_unsupported_architecture_lists_the_supported():
    assert {"LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"} <= set(
        ARCHITECTURES
    )
    with pytest.raises(ValueError, match=r"not supported; supported: " + re.escape(str(sorted(ARCHITECTURES)))):
        resolve_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"]))


def test_resolving_imports_only_the_family_module():
    code = (
        "import sys; from types import SimpleNamespace; from tandem.models.registry import resolve_model_class;"
        "resolve_model_class(SimpleNamespace(architectures=['Qwen2ForCausalLM']));"
        "print(sorted(m for m in sys.modules if m.startswith('tandem.models.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["tandem.models.base", "tandem.models.context", "tandem.models.qwen2", "tandem.models.registry"]


def test_family_options_are_explicit():
    config = SimpleNamespace(attention_bias=False, model_type="llama")  # model_type is not read
    for arch, want in [
        ("LlamaForCausalLM", LayerOptions()),
        ("MistralForCausalLM", LayerOptions()),
        ("Qwen2ForCausalLM", LayerOptions(qkv_bias=True)),
        ("Qwen3ForCausalLM", LayerOptions(qk_norm=True)),
        ("MixtralForCausalLM", LayerOptions()),
        ("Qwen2MoeForCausalLM", LayerOptions(qkv_bias=True)),
        ("Qwen3MoeForCausalLM", LayerOptions(qk_norm=True)),
    ]:
        assert resolve_model_class(SimpleNamespace(architectures=[arch])).layer_options(config, 0) == want
    with pytest.raises(ValueError, match="activation 'relu' is not supported"):
        LayerOptions(activation="relu")


@pytest.mark.parametrize(
    "name, want",
    [
        ("model.layers.0.self_attn.q_proj.weight", ("model.layers.0.self_attn.qkv_proj.weight", "q")),
        ("model.layers.11.self_attn.k_proj.bias", ("model.layers.11.self_attn.qkv_proj.bias", "k")),
        ("model.layers.2.self_attn.v_proj.weight", ("model.layers.2.self_attn.qkv_proj.weight", "v")),
        ("model.layers.0.mlp.gate_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", 0)),
        ("model.layers.0.mlp.up_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", 1)),
        # not the dense layer's fused projections
        ("model.layers.0.mlp.experts.3.gate_proj.weight", None),
        ("model.layers.0.mlp.experts.3.up_proj.weight", None),
        ("model.layers.0.mlp.shared_expert.gate_proj.weight", None),
        ("model.layers.0.mlp.down_proj.weight", None),
        ("model.layers.0.self_attn.o_proj.weight", None),
        ("model.layers.0.self_attn.q_norm.weight", None),
        ("model.layers.0.self_attn.xq_proj.weight", None),  # a component that merely ends in q_proj
        ("model.layers.0.mlp.gate_proj_scale", None),
    ],
)
def test_dense_stacked_mapping_matches_whole_components(name, want):
    assert stacked_param_target(name, DENSE_STACKED_PARAMS) == want


def test_a_mapping_of_expert_projections():
    experts = [StackedParam("gate_proj", "gate_up_proj", 0)]
    assert stacked_param_target("model.layers.0.mlp.experts.3.gate_proj.weight", experts) == (
        "model.layers.0.mlp.experts.3.gate_up_proj.weight",
        0,
    )
