"""build_sglang's engine arguments: strict mode on a GPU selects what minite.rollout.sglang.strict replaces
(torch_native attention, eager), rollout.sglang_args comes on top, and a strict run asking for another attention
backend or for CUDA graphs is refused in one line. Pure config logic: no engine starts."""
import pytest

from minite.config import ConfigError, load_config
from minite.rollout.sglang.engine import engine_args_for


def _cfg(*sets):
    return load_config("examples/tiny/nvfp4.yaml", ["rollout.backend=sglang", *sets])


def test_default_mode_takes_sglang_args_as_given():
    assert engine_args_for(_cfg(), "cuda") == {}
    cfg = _cfg("rollout.sglang_args={attention_backend: triton, mem_fraction_static: 0.3}")
    assert engine_args_for(cfg, "cuda") == {"attention_backend": "triton", "mem_fraction_static": 0.3}


def test_strict_on_a_gpu_selects_torch_native_and_eager():
    args = engine_args_for(_cfg("alignment.strict=true"), "cuda")
    assert args["attention_backend"] == "torch_native" and args["disable_cuda_graph"] is True
    assert engine_args_for(_cfg("alignment.strict=true"), "cpu") == {}  # the CPU defaults are already these
    args = engine_args_for(_cfg("alignment.strict=true", "rollout.sglang_args={disable_radix_cache: true}"), "cuda")
    assert args["disable_radix_cache"] is True and args["attention_backend"] == "torch_native"


@pytest.mark.parametrize("extra, match", [("{attention_backend: triton}", "torch_native"),
                                          ("{decode_attention_backend: fa3}", "torch_native"),
                                          ("{prefill_attention_backend: triton}", "torch_native"),
                                          ("{disable_cuda_graph: false}", "eagerly"),
                                          ("{disable_cuda_graph: 0}", "eagerly"),
                                          ("{cuda_graph_backend_decode: full}", "cuda_graph_backend_decode"),
                                          ("{cuda_graph_config: x}", "cuda_graph_config"),
                                          ("{enable_torch_compile: true}", "enable_torch_compile")])
def test_strict_refuses_what_it_cannot_run(extra, match):
    for device in ("cuda", "cpu"):
        with pytest.raises(ValueError, match=match):
            engine_args_for(_cfg("alignment.strict=true", f"rollout.sglang_args={extra}"), device)


def test_strict_checks_the_merged_arguments():
    """build_sglang's own engine_args are merged before the check, not after it."""
    with pytest.raises(ValueError, match="torch_native"):
        engine_args_for(_cfg("alignment.strict=true"), "cuda", {"attention_backend": "triton"})
    assert engine_args_for(_cfg(), "cuda", {"attention_backend": "triton"}) == {"attention_backend": "triton"}


def test_sglang_args_must_be_a_mapping():
    with pytest.raises(ConfigError, match="sglang_args"):
        _cfg("rollout.sglang_args=triton")
