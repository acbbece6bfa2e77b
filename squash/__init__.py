"""squash: Sparse, Quantized fine-tuning using Adapters at home.

Importing squash registers the ``torch.ops.squash`` custom ops (native kernels compile on first
use) and the OmegaConf resolver ``${squash_asset:NAME}`` that configs name shipped files with.
"""

from squash import ops, sparsity  # noqa: F401  (registers torch.ops.squash.*)
from squash.assets import register_resolvers

register_resolvers()

__version__ = "0.2.1"
