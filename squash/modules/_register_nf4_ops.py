"""NF4 dispatch overrides squash needs, registered in torchao's NF4 op table on import.

torchtune's ``_register_nf4_dispatch_ops`` (imported first, so that this registration is the
last) makes ``clone`` re-quantize the dequantized weight with torchao's default block sizes,
which fails on, or silently changes, a weight quantized with other sizes
(:func:`squash.modules._nf4.nf4_block_sizes`). Here ``clone`` copies the quantized parts
themselves, block sizes included: the copy dequantizes to exactly the original's values.
"""

import torch
from torchtune.modules.low_precision import _register_nf4_dispatch_ops  # noqa: F401

try:
    from torchao.dtypes.nf4tensor import NF4Tensor, implements
except ImportError:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (  # type: ignore
        NF4Tensor,
        implements,
    )


@implements([torch.ops.aten.clone.default])
def clone(func, *args, **kwargs):
    """An NF4 tensor's clone with its own block sizes and quantized values."""
    original = args[0][0]
    names, ctx = original.__tensor_flatten__()
    inner = {n: getattr(original, n).clone() for n in names}
    return NF4Tensor.__tensor_unflatten__(inner, ctx, original.shape, original.stride())
