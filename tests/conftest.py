import pytest
import torch


def sqnr_db(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approx`` against ``ref``, in dB."""
    ref, approx = ref.detach().double(), approx.detach().double()
    return float(20 * torch.log10(ref.norm() / (approx - ref).norm()))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="needs an SM90+ GPU for block-scaled scaled_mm",
)


def compile_for_sm90(fn, constexprs: dict, pointers: dict, floats: tuple = (), **options):
    """Compile a Triton kernel's GPU path for sm_90 with Triton's bundled ptxas (no GPU needed).

    Arguments ending in ``_ptr`` are pointers (``pointers[name]``, default ``*fp32``), those in
    ``floats`` fp32 scalars, the rest i32 (or constexpr if in ``constexprs``).
    """
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def arg_type(name):
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            return pointers.get(name, "*fp32")
        return "fp32" if name in floats else "i32"

    signature = {name: arg_type(name) for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 2, **options})
