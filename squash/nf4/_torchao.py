"""torchao's NF4 tensor and its helpers, from whichever location this torchao has them in: the one
place squash imports them from. squash only calls these; it replaces none of torchao's attributes
and registers nothing in torchao's NF4 op table.

torchao < 0.16 (what torchtune 0.6.1 needs) keeps NF4 in ``torchao.dtypes.nf4tensor``; later
releases moved it to ``torchao.quantization.quantize_.workflows.nf4.nf4_tensor``.
"""

try:
    from torchao.dtypes.nf4tensor import (
        NF4Tensor,
        SubclassTensorArgs,
        get_block_absmax,
        linear_nf4,
        to_nf4,
    )
except ImportError:  # torchao >= 0.16
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (  # type: ignore
        NF4Tensor,
        SubclassTensorArgs,
        get_block_absmax,
        linear_nf4,
        to_nf4,
    )

__all__ = ["NF4Tensor", "SubclassTensorArgs", "get_block_absmax", "linear_nf4", "to_nf4"]
