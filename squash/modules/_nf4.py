"""torchao's NF4 tensor, from whichever location this torchao has it in.

torchao < 0.16 (what torchtune 0.6.1 needs) keeps NF4 in ``torchao.dtypes.nf4tensor``; later
releases moved it to ``torchao.quantization.quantize_.workflows.nf4.nf4_tensor``.
"""

try:
    from torchao.dtypes.nf4tensor import NF4Tensor, linear_nf4, to_nf4
except ImportError:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (  # type: ignore
        NF4Tensor,
        linear_nf4,
        to_nf4,
    )

__all__ = ["NF4Tensor", "check_nf4_shape", "linear_nf4", "to_nf4"]


def check_nf4_shape(
    name: str, shape: tuple, block_size: int = 64, scaler_block_size: int = 256
) -> None:
    """Refuse, naming ``name``, a weight shape that torchao cannot quantize to NF4.

    torchao's ``to_nf4`` quantizes blocks of ``block_size`` elements and then the block scalers in
    blocks of ``scaler_block_size``, so the number of elements must be a multiple of
    ``block_size * scaler_block_size`` (16384 with the defaults); otherwise it fails with a bare
    ``AssertionError`` (or, under ``python -O``, a reshape error).

    Raises:
        ValueError: naming the module, the shape and the block sizes.
    """
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    unit = block_size * scaler_block_size
    if len(shape) > 2 or numel == 0 or numel % unit != 0:
        raise ValueError(
            f"{name}: cannot quantize a weight of shape {shape} ({numel} elements) to NF4 with "
            f"torchao's block_size={block_size} and scaler_block_size={scaler_block_size}: the "
            f"number of elements must be a non-zero multiple of block_size * scaler_block_size "
            f"= {unit} (use quantize_base=False for this layer's size)"
        )
