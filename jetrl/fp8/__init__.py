"""FP8 core: the one quantizer, block-FP8 GEMMs, Float8Linear, FP8 K/V and the precision recipes."""

from jetrl.fp8.convert import (
    check_model_precision,
    convert_to_float8,
    default_module_filter,
    float8_modules,
    model_recipe,
    refresh_weight_caches,
)
from jetrl.fp8.gemm import fp8_gemm, gemm_emulated, override_backend, resolve_backend
from jetrl.fp8.kv_quant import dequantize_kv, fake_quantize_kv, quantize_kv
from jetrl.fp8.linear import Float8Linear
from jetrl.fp8.quant import Float8Blocks, NonFiniteError, quantize, record_quantization
from jetrl.fp8.recipe import (
    RECIPE_NAMES,
    KVCacheSpec,
    LinearPrecision,
    OffPolicyRecipeError,
    QuantSpec,
    Recipe,
    check_rollout_subgraph,
    current_phase,
    get_recipe,
    precision_phase,
)
from jetrl.fp8.refresh_graph import WeightRefresh
from jetrl.fp8.weight_cache import track_optimizer

__all__ = [
    "RECIPE_NAMES",
    "Float8Blocks",
    "Float8Linear",
    "KVCacheSpec",
    "LinearPrecision",
    "NonFiniteError",
    "OffPolicyRecipeError",
    "QuantSpec",
    "Recipe",
    "WeightRefresh",
    "check_model_precision",
    "check_rollout_subgraph",
    "convert_to_float8",
    "current_phase",
    "default_module_filter",
    "dequantize_kv",
    "fake_quantize_kv",
    "float8_modules",
    "fp8_gemm",
    "gemm_emulated",
    "get_recipe",
    "model_recipe",
    "override_backend",
    "precision_phase",
    "quantize",
    "quantize_kv",
    "record_quantization",
    "refresh_weight_caches",
    "resolve_backend",
    "track_optimizer",
]
