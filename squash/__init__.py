"""squash: Sparse, Quantized fine-tuning using Adapters at home.

Importing squash registers the ``torch.ops.squash`` custom ops; native kernels compile on first use.
"""

from squash import ops, sparsity  # noqa: F401  (ops registers torch.ops.squash.*)

__version__ = "0.2.1"
