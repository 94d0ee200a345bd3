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
    ``floats`` fp32 scalars, the rest i32 without specialization (or constexpr if in ``constexprs``).
    A thin layer over :func:`jetrl.bench.sass.compile_like_launch`, which takes real example arguments.
    """
    pytest.importorskip("triton")
    from jetrl.bench.sass import compile_like_launch

    dtypes = {"*fp32": torch.float32, "*bf16": torch.bfloat16, "*fp16": torch.float16, "*u8": torch.uint8,
              "*i32": torch.int32, "*i64": torch.int64, "*fp8e4nv": torch.float8_e4m3fn}

    def example(name):
        if name.endswith("_ptr"):
            return torch.empty(1, dtype=dtypes[pointers.get(name, "*fp32")])
        return 0.5 if name in floats else 3  # an int that a launch would not specialize

    args = {name: example(name) for name in fn.arg_names if name not in constexprs}
    return compile_like_launch(fn, args, constexprs, num_warps=options.get("num_warps", 4),
                               num_stages=options.get("num_stages", 2), arch=options.get("arch", 90))
