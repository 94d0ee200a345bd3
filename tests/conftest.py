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
