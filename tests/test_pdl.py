"""Programmatic dependent launch (jetrl/fp8/kernels/pdl.py).

What defines it: off the GPU nothing changes (no launch attribute, the instructions compiled out);
every kernel that takes ``PDL`` waits for the previous kernel *before* its first global load or store
and releases the next one only after that wait (checked in the PTX, no GPU needed); on an SM90 GPU the
engine's CUDA-graph decode gives the same tokens and logprobs, bit for bit, with PDL on and off.
"""

from __future__ import annotations

import copy
import importlib
import re

import pytest
import torch

from jetrl.fp8.kernels import has_triton

from .conftest import compile_for_sm90, requires_sm90

pytestmark = pytest.mark.skipif(not has_triton(), reason="needs Triton")

# every module with Triton kernels that take the PDL constexpr
KERNEL_MODULES = ("jetrl.fp8.kernels.quant_triton", "jetrl.fp8.kernels.gemm_triton",
                  "jetrl.models.kernels.fused_triton", "jetrl.engine.kernels.kv_store_triton",
                  "jetrl.engine.kernels.decode_attention_triton", "jetrl.engine.kernels.row_order_triton",
                  "jetrl.engine.kernels.sample_triton")
_GLOBAL_ACCESS = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global|cp\.reduce)")


def _pdl_kernels() -> dict[str, object]:
    import triton

    found = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (isinstance(value, triton.runtime.jit.JITFunction) and "PDL" in value.arg_names
                    and value.__module__ == name):  # not the imported helper
                found[attr] = value
    return found


def _cases():
    """(kernel name, constexprs, pointer dtypes, float args) for one sm_90 compile of each PDL kernel."""
    import triton.language as tl

    bf16 = tl.bfloat16
    return {
        "_quantize_kernel": ({"GROUP_ROWS": 1, "GROUP_COLS": 128, "TILE_R": 32, "POW2": False,
                              "EXPLICIT_ROUND": False}, {"x_ptr": "*bf16", "codes_ptr": "*u8"}, ()),
        "_quantize_dual_kernel": ({"POW2": False, "EXPLICIT_ROUND": False, "CHUNK": 64},
                                  {"x_ptr": "*bf16", "codes_ptr": "*u8", "codes_t_ptr": "*u8"}, ()),
        "_gemm_small_m_kernel": ({"GROUPS_PER_SPLIT": 8, "SPLIT_K": 4, "BLOCK_M": 16, "BLOCK_N": 64},
                                 {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "count_ptr": "*i32"},
                                 ()),
        "_rms_norm_kernel": ({"BLOCK_R": 1, "BLOCK_C": 4096, "X_DTYPE": bf16, "OUT_DTYPE": bf16, "EMULATE": False,
                              "ADD": True}, {n: "*bf16" for n in ("x_ptr", "w_ptr", "out_ptr", "d_ptr", "h_ptr")},
                             ("eps",)),
        "_rope_kernel": ({"HALF": 64, "BLOCK_R": 16, "DTYPE": bf16, "BACKWARD": False, "EMULATE": False},
                         {n: "*bf16" for n in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")}, ()),
        "_norm_rope_kernel": ({"HALF": 64, "BLOCK_R": 16, "NORM": True, "DTYPE": bf16, "EMULATE": False},
                              {n: "*bf16" for n in ("q_ptr", "k_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr",
                                                    "qo_ptr", "ko_ptr")}, ("eps",)),
        "_silu_mul_kernel": ({"BLOCK": 1024, "DTYPE": bf16, "EMULATE": False},
                             {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16"}, ()),
        "_store_kv_kernel": ({"D": 128, "BLOCK_H": 8, "FP8": True, "POW2": True, "EXPLICIT_ROUND": False},
                             {"k_ptr": "*bf16", "v_ptr": "*bf16", "lengths_ptr": "*i64", "ck_ptr": "*u8",
                              "cv_ptr": "*u8"}, ()),
        "_decode_attention_kernel": ({"G": 4, "DTYPE": bf16, "BLOCK_G": 4, "BLOCK_S": 32, "BLOCK_D": 128,
                                      "NUM_SPLITS": 2, "IS_FP8": True, "POW2_SCALES": True, "ROW_ORDER": True,
                                      "EMULATE": False},
                                     {"q_ptr": "*bf16", "k_ptr": "*u8", "v_ptr": "*u8", "lengths_ptr": "*i64",
                                      "row_order_ptr": "*i64", "out_ptr": "*bf16"}, ("qk_scale",)),
        "_merge_splits_kernel": ({"DTYPE": bf16, "NUM_SPLITS": 4, "SPLITS_P2": 4, "BLOCK_S": 64, "BLOCK_D": 128,
                                  "EMULATE": False}, {"lengths_ptr": "*i64", "out_ptr": "*bf16"}, ()),
        "_longest_first_kernel": ({"BLOCK": 64, "CHUNK": 64}, {"len_ptr": "*i64", "order_ptr": "*i64"}, ()),
        "_chunk_stats_kernel": ({"BLOCK": 1024, "TILES": 4, "SCALE": True, "GREEDY": False},
                                {"logits_ptr": "*bf16", "arg_ptr": "*i32"}, ("inv_temperature",)),
        "_draw_kernel": ({"BLOCK": 1024, "TILES": 4, "BLOCK_C": 64, "SCALE": True, "GREEDY": False},
                         {"logits_ptr": "*bf16", "arg_ptr": "*i32", "keys_ptr": "*i64", "steps_ptr": "*i64",
                          "tokens_ptr": "*i64"}, ("inv_temperature",)),
    }


def test_off_the_gpu_nothing_changes(monkeypatch):
    from jetrl.fp8.kernels import pdl

    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    with pdl.use_pdl(True):  # forcing it on cannot turn it on where there is no SM90 GPU
        assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    with pytest.raises(ValueError, match="unknown PDL setting"):
        with pdl.use_pdl("yes"):
            pass


def test_bad_environment_value_is_rejected(monkeypatch):
    from jetrl.fp8.kernels import pdl

    monkeypatch.setenv("JETRL_PDL", "on")
    with pytest.raises(ValueError, match=r"JETRL_PDL='on' is not a valid choice; use one of 0, 1"):
        pdl.env_setting()
    monkeypatch.setenv("JETRL_PDL", "0")
    assert pdl.env_setting() is False


def test_every_pdl_kernel_waits_before_touching_memory():
    """The protocol of pdl.py in each kernel's PTX: griddepcontrol.wait precedes the first global access,
    and launch_dependents follows the wait (so an early kernel overlaps only its direct predecessor)."""
    kernels, cases = _pdl_kernels(), _cases()
    assert set(kernels) == set(cases), f"PDL kernels without a protocol check: {set(kernels) ^ set(cases)}"
    for name, (constexprs, pointers, floats) in cases.items():
        ptx = compile_for_sm90(kernels[name], {**constexprs, "PDL": True}, pointers, floats).asm["ptx"]
        wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        first_access = _GLOBAL_ACCESS.search(ptx)
        assert 0 <= wait < release, (name, wait, release)
        assert first_access is not None and release < first_access.start(), (name, first_access)
        plain = compile_for_sm90(kernels[name], {**constexprs, "PDL": False}, pointers, floats).asm["ptx"]
        assert "griddepcontrol" not in plain, name


@requires_sm90
@pytest.mark.parametrize("recipe", ["bf16", "jet", "jet_kv"])
def test_cuda_graph_decode_is_bit_identical_with_and_without_pdl(recipe):
    from jetrl import fp8
    from jetrl.engine import Engine, SamplingParams
    from jetrl.fp8.kernels.pdl import use_pdl
    from jetrl.models import CausalLM

    from .engine_helpers import LOGPROB_CONFIG, random_prompts

    torch.manual_seed(1)
    base = CausalLM(LOGPROB_CONFIG).to("cuda", torch.bfloat16)
    model = base if recipe == "bf16" else fp8.convert_to_float8(copy.deepcopy(base), fp8.get_recipe(recipe))
    prompts = random_prompts([5, 17, 33, 9], seed=1, vocab=512)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=0)
    outs = {}
    for on in (False, True):
        with use_pdl(on):
            engine = Engine(model, max_slots=16, max_len=96)  # graphs captured under this setting
            outs[on] = engine.generate(prompts, params)
            assert engine.graphs.num_captures >= 1
    for a, b in zip(outs[False], outs[True]):
        for ca, cb in zip(a, b):
            assert ca.token_ids == cb.token_ids and ca.logprobs == cb.logprobs
